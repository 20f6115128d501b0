"""Capsules: the guarded run's bad step replays exactly; bad capsules are refused with exit 2."""

from __future__ import annotations

import pickle

import pytest
import torch
from typer.testing import CliRunner

from conftest import asset, example, output_lines
from nanprobe import diagnose
from nanprobe.capsule import list_capsules
from nanprobe.surface.cli import app
from nanprobe.reach.entry import load_target
from nanprobe.live.guard import Guard

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
    lines = output_lines(result.output)
    assert len(lines) == 1 and lines[0].startswith("nanprobe: error: ") and "Traceback" not in result.output
    assert "this must never run" not in result.output


def test_capsule_from_another_model_exits_2(tmp_path):
    guarded_run(tmp_path)
    (capsule,) = list_capsules(tmp_path)
    result = _run_capsule(capsule, entry=example("healthy_mlp.py") + ":target")
    assert result.exit_code == 2
    assert "another model" in result.output


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_plain_pickle_is_refused(tmp_path):
    bad = tmp_path / "x.capsule.pt"
    bad.write_bytes(pickle.dumps({"a": 1}))
    assert _run_capsule(bad).exit_code == 2


# -- batches, RNG, names ------------------------------------------------------------------------------

import collections  # noqa: E402
import dataclasses  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402

from nanprobe import capsule as C  # noqa: E402

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Item:
    ids: torch.Tensor
    label: int


@pytest.mark.parametrize("batch", [
    (torch.arange(3), torch.ones(2, 2)),
    [torch.zeros(1), 3, "text", None, 2.5],
    {"x": torch.randn(2, 3), "meta": {"ids": [1, 2], "source": "s", 7: torch.tensor([1])}},
    collections.OrderedDict(a=torch.ones(1), b=[torch.zeros(2)]),
    Pair(a=torch.ones(2), b=(1, torch.zeros(1))),
    Item(ids=torch.arange(4), label=2),
    {"arr": np.arange(3, dtype=np.float32), "n": np.int64(4)},
], ids=["tuple", "list", "nested-dict", "ordered", "namedtuple", "dataclass", "numpy"])
def test_batches_survive_weights_only_round_trip(tmp_path, batch):
    path = tmp_path / "b.pt"
    torch.save({"batch": C.encode_batch(batch)}, path)
    notes: list[str] = []
    back = C.decode_batch(torch.load(path, weights_only=True)["batch"], None, notes)
    assert type(back) is type(batch) and notes == []
    assert repr(C.encode_batch(back)) == repr(C.encode_batch(batch))


def test_unknown_batch_types_are_rebuilt_plainly_with_a_note():
    enc = C.encode_batch(Item(ids=torch.arange(2), label=1))
    enc["type"] = "gone_module:Gone"
    notes: list[str] = []
    back = C.decode_batch(enc, None, notes)
    assert back == {"ids": back["ids"], "label": 1} and "not importable here" in notes[0]


def test_dataclass_batch_found_in_the_entrypoint_module(tmp_path):
    """The run defined the batch class in __main__; replay finds it in the loaded entrypoint by name."""
    entry = asset("guard_nan.py") + ":dataclass_batches"
    guarded_run(tmp_path, entry)
    (capsule,) = list_capsules(tmp_path)
    data = torch.load(capsule, weights_only=True)
    data["micro_batches"][0]["type"] = "__main__:Batch"
    torch.save(data, capsule)
    from nanprobe.capsule import reach_from_capsule
    loaded = load_target(entry)
    reached = reach_from_capsule(capsule, loaded)
    assert type(reached.batch).__name__ == "Batch" and reached.notes == []
    assert torch.equal(reached.batch.x[2], torch.zeros(4))


def test_rng_states_round_trip_as_lists():
    from nanprobe.reach.state import capture_rng, set_rng
    state = capture_rng("cpu")
    safe = C.rng_to_safe(state)
    assert isinstance(safe["python"][1], list) and isinstance(safe["numpy"][1], list)
    expected = (torch.rand(3), random.random(), np.random.rand())
    set_rng(C.rng_from_safe(safe, "cpu"))
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


def test_capsule_and_at_disagree_is_a_usage_error(tmp_path):
    guarded_run(tmp_path)
    (capsule,) = list_capsules(tmp_path)
    result = CliRunner().invoke(app, ["run", ENTRY, "--capsule", str(capsule), "--at", "2"])
    assert result.exit_code == 2 and "holds step 4, not --at 2" in result.output


def test_not_a_capsule_and_another_models_capsule_messages(tmp_path):
    plain = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, plain)
    result = _run_capsule(plain)
    assert result.exit_code == 2 and "not a nanprobe capsule" in result.output
    guarded_run(tmp_path)
    (capsule,) = list_capsules(tmp_path)
    result = _run_capsule(capsule, entry=asset("guard_nan.py") + ":other_model")
    assert result.exit_code == 2 and "capsule is from another model" in result.output


def test_stale_capsule_for_at_is_skipped_with_a_note(tmp_path, monkeypatch):
    """--at N with a capsule of another model in the folder: replay instead, and say why."""
    guarded_run(tmp_path / "nanprobe-capsules")
    monkeypatch.chdir(tmp_path)
    other = asset("guard_nan.py") + ":other_model"
    report = diagnose(other, at=BAD)
    assert report.reached_by == "replay from step 0"
    assert any("not used" in n and "another model" in n for n in report.notes)


def test_write_never_replaces_an_existing_file(tmp_path, monkeypatch):
    monkeypatch.setattr(C.io, "capsule_name", lambda step, rank, attempt=0:
                        f"step{step:07d}-rank{rank}-fixed{'-' + str(attempt) if attempt else ''}{C.SUFFIX}")
    taken = tmp_path / f"step0000003-rank0-fixed{C.SUFFIX}"
    taken.write_bytes(b"the user's own file")
    path = C.write({"step": 3, "rank": 0, "payload": torch.ones(1)}, tmp_path)
    assert path.name == f"step0000003-rank0-fixed-1{C.SUFFIX}"
    assert taken.read_bytes() == b"the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([taken.name, path.name])   # no temp file left


def test_compiled_and_ddp_wrappers_are_unwrapped_for_names_and_state():
    import torch.nn as nn

    from nanprobe.capsule import fingerprint, unwrap

    net = nn.Sequential(nn.Linear(2, 3))
    compiled = torch.compile(net)   # compiles lazily: nothing runs here
    assert unwrap(compiled) is net
    assert fingerprint(compiled) == [["0.weight", [3, 2]], ["0.bias", [3]]]   # no "_orig_mod." prefix


def test_a_complete_torch_save_file_with_bytes_after_its_end_is_not_called_truncated(tmp_path):
    """Truncation is a missing end record; a whole file that has bytes after it (appended by a copy tool) keeps
    its end record and is judged by what it holds, not as cut off."""
    from nanprobe.capsule.io import truncation

    path = tmp_path / "whole.pt"
    torch.save({"x": torch.ones(3)}, path)
    assert truncation(path) is None
    with open(path, "ab") as fh:
        fh.write(b"\0" * 17)
    assert truncation(path) is None
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert truncation(path) is not None
