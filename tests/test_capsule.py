"""Capsules: the guarded run's bad step replays exactly; bad capsules are refused with exit 2."""

from __future__ import annotations

import pickle

import pytest
import torch
from typer.testing import CliRunner

from conftest import asset, example
from nanprobe import diagnose
from nanprobe.capsule import list_capsules
from nanprobe.cli import app
from nanprobe.entry import load_target
from nanprobe.guard import Guard

ENTRY = asset("guard_nan.py") + ":target"
BAD = 4


def guarded_run(tmp_path, entry=ENTRY):
    t = load_target(entry).target
    guard = Guard(t.model, t.optimizer, scheduler=t.scheduler, entry=entry, capsule_dir=tmp_path)
    for batch in t.batches:
        with guard.step(batch):
            t.optimizer.zero_grad(set_to_none=True)
            guard.backward(t.loss_fn(t.model, batch))
        if guard.optimizer_step():
            t.scheduler.step()
    return guard


def _key(report):
    top = report.top
    return report.step, report.status.value, top.cause.value, top.phase.value, top.module, \
        report.origin.op if report.origin else None


def test_capsule_replay_gives_the_same_diagnosis_as_at_k(tmp_path, monkeypatch):
    guard = guarded_run(tmp_path)
    (capsule,) = list_capsules(tmp_path)
    assert guard.events[0].step == BAD
    from_capsule = diagnose(ENTRY, capsule=str(capsule))
    assert "capsule" in from_capsule.reached_by
    monkeypatch.chdir(tmp_path.parent)  # no capsule folder here: --at replays from step 0
    by_replay = diagnose(ENTRY, at=BAD)
    assert "replay" in by_replay.reached_by
    assert _key(from_capsule) == _key(by_replay) == (BAD, "nonfinite", "div", "forward", "norm", "aten.div.Tensor")
    # the same state: module output ranges up to the origin are bitwise the same numbers
    assert from_capsule.context and from_capsule.context == by_replay.context


def test_capsule_loads_with_weights_only(tmp_path):
    guarded_run(tmp_path)
    (capsule,) = list_capsules(tmp_path)
    data = torch.load(capsule, weights_only=True)
    assert isinstance(data, dict) and data


def test_run_at_k_finds_the_capsule_in_the_capsule_folder(tmp_path, monkeypatch):
    guarded_run(tmp_path / "nanprobe-capsules")
    monkeypatch.chdir(tmp_path)
    report = diagnose(ENTRY, at=BAD)
    assert "capsule" in report.reached_by and report.top.cause.value == "div"


def _run_capsule(path, entry=ENTRY):
    return CliRunner().invoke(app, ["run", entry, "--capsule", str(path)])


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize("kind", ["truncated", "random", "pickle_code", "missing"])
def test_bad_capsules_exit_2_with_one_line(tmp_path, kind):
    guarded_run(tmp_path)
    (good,) = list_capsules(tmp_path)
    bad = tmp_path / f"{kind}.capsule.pt"
    if kind == "truncated":
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif kind == "random":
        bad.write_bytes(bytes(range(256)) * 8)
    elif kind == "pickle_code":
        torch.save({"nanprobe_capsule": 1, "evil": Evil()}, bad, _use_new_zipfile_serialization=True)
    result = _run_capsule(bad)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("nanprobe: error: ") and "Traceback" not in result.output
    assert "this must never run" not in result.output


def test_capsule_from_another_model_exits_2(tmp_path):
    guarded_run(tmp_path)
    (capsule,) = list_capsules(tmp_path)
    result = _run_capsule(capsule, entry=example("healthy_mlp.py") + ":target")
    assert result.exit_code == 2
    assert "another model" in result.output


def test_plain_pickle_is_refused(tmp_path):
    bad = tmp_path / "x.capsule.pt"
    bad.write_bytes(pickle.dumps({"a": 1}))
    assert _run_capsule(bad).exit_code == 2
