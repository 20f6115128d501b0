"""Precision is a property of the tensors: pure bf16 weights (no autocast) are reported as bf16, and reruns
in fp32/fp64 cast the weights, optimizer state and batch for real and put them back bitwise."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_one_story, assert_same_state, asset, example, state_of
from nanprobe import diagnose
from nanprobe.compare import compare_precisions
from nanprobe.base.config import load_config
from nanprobe.reach.entry import load_target
from nanprobe.base.precision import Precision, weights_precision
from nanprobe.reach.replay import reach
from nanprobe.base.report import Phase
from nanprobe.locate.rerun import run_step

W = asset("weights_targets.py")
PURE = "bf16_pure_variance_shortcut.py"


def _example_module(name: str):
    """The example file as a fresh module (its own objects, not the ones nanprobe loads)."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}", example(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plain_first_bad(name: str) -> int | None:
    """The first non-finite step of the example's plain loop (bf16/fp16 CPU kernels decide it)."""
    sys.path.insert(0, str(Path(example(name)).parent))   # conftest restores sys.path
    from plain_loop import train
    step, _ = train(_example_module(name).target(), verbose=False)
    return step


def test_weights_precision_reads_the_parameters_dtype():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert weights_precision(m) is None
    assert weights_precision(m.to(torch.bfloat16)) is Precision.BF16
    assert weights_precision(m.to(torch.float16)) is Precision.FP16
    assert weights_precision(m.to(torch.float64)) is None


def test_pure_bf16_run_is_reported_as_bf16_and_fp32_is_finite():
    report = diagnose(example(PURE) + ":target")
    assert report.step == _plain_first_bad(PURE)
    assert report.precision == "bf16" and "no autocast" in report.autocast_policy
    top = report.top
    assert_one_story(report)
    assert (top.cause.value, top.phase.value, top.module) == ("sqrt", "forward", "standardize"), report.to_json()
    assert (report.origin.phase.value, report.origin.module) == ("forward", "standardize")
    assert report.precisions["bf16"].finite is False
    assert report.precisions["fp32"].finite is True
    assert any("precision is the problem" in line for line in top.evidence)
    island = top.fixes[0]   # the island hands the next bf16 layer a bf16 tensor again
    assert "fp32 island among bf16 weights" in island.title and "out.to(torch.bfloat16)" in island.code


def test_compare_precisions_on_pure_bf16_finds_fp32_and_fp64_finite():
    cmp = compare_precisions(example(PURE) + ":target", precisions="fp64,fp32,bf16")
    p = cmp.precisions
    assert cmp.precision == "bf16"
    assert (p["fp64"].finite, p["fp32"].finite, p["bf16"].finite) == (True, True, False)
    assert p["bf16"].origin.module == "standardize"
    assert cmp.recommended == "fp32" and cmp.recommendation.startswith("precision is the problem")
    assert "rounds inputs of aten.sqrt.default in standardize to 0" in cmp.recommendation
    assert "underflows" not in cmp.recommendation   # the fp64 values are far inside bf16's range


@pytest.mark.parametrize("precision, dtype", [(Precision.FP32, torch.float32), (Precision.FP64, torch.float64)])
def test_reruns_cast_weights_state_and_batch_and_put_them_back_bitwise(precision, dtype):
    loaded = load_target(f"{W}:pure_bf16")
    target = loaded.target
    assert target.precision is Precision.BF16 and target.pure
    reached = reach(target, at=3, precision=target.precision, cfg=load_config().replay, where=loaded.where)
    before = state_of(target)
    seen: dict[str, set] = {"grad": set(), "state": set()}

    def observe(phase):
        if phase is Phase.UPDATE:
            seen["grad"] |= {p.grad.dtype for p in target.model.parameters()}
            seen["state"] |= {v.dtype for s in target.optimizer.state.values() for k, v in s.items() if k != "step"}
    t = run_step(target, reached, precision, where=loaded.where, instrument=True, observe=observe, update=True)
    assert t.finite and not t.trace.events
    assert seen == {"grad": {dtype}, "state": {dtype}}   # the update ran on cast weights and state
    assert_same_state(target, before)
    assert {p.dtype for p in target.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    own = run_step(target, reached, Precision.BF16, where=loaded.where, instrument=False)
    assert own.record.loss != t.record.loss   # the rerun really computed in another dtype
    assert own.record.loss == pytest.approx(t.record.loss, rel=2e-2)
    assert_same_state(target, before)


MASTER = "fp16_master_weights.py"


def test_fp16_weights_with_fp32_master_copies_replay_bitwise():
    mod = _example_module(MASTER)
    model, masters, opt = mod.make()               # the plain loop, 10 steps
    for batch in mod.make_batches()[:10]:
        mod.train_step(model, masters, opt, batch)
    loaded = load_target(example(MASTER) + ":target")
    target = loaded.target
    assert target.precision is Precision.FP16 and len(target.masters) == len(list(target.model.parameters()))
    reach(target, at=10, precision=target.precision, cfg=load_config().replay, where=loaded.where)
    for a, b in zip(model.parameters(), target.model.parameters()):
        assert a.dtype == b.dtype == torch.float16 and torch.equal(a, b)
    for a, (_, b) in zip(masters, target.masters):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    state = opt.state_dict()["state"]
    for i, entry in target.optimizer.state_dict()["state"].items():
        assert all(torch.equal(v, state[i][k]) for k, v in entry.items())


def test_fp16_master_copies_diagnosed_and_their_capsule_replays_bitwise(tmp_path):
    from nanprobe.live.guard import Guard
    mod = _example_module(MASTER)
    expected = mod.first_bad_step()
    report = diagnose(example(MASTER) + ":target")
    assert_one_story(report)
    assert (report.step, report.precision) == (expected, "fp16")
    top = report.top
    assert (top.cause.value, top.phase.value, top.module) == ("overflow", "forward", "attn")
    assert report.fidelity.reproduced is True and report.precisions["fp32"].finite is True
    # the Guard in the user's own loop: the bad step is skipped, its capsule replays bitwise
    model, masters, opt = mod.make()
    guard = Guard(model, opt, capsule_dir=tmp_path, entry=example(MASTER) + ":target")
    applied = []
    for batch in mod.make_batches()[:expected + 1]:
        with guard.step(batch):
            loss = torch.nn.functional.cross_entropy(model(batch["x"]).float(), batch["y"])
            model.zero_grad(set_to_none=True)
            guard.backward(loss * mod.LOSS_SCALE)
            for p, m in zip(model.parameters(), masters):
                m.grad = p.grad.float() / mod.LOSS_SCALE
        applied.append(guard.optimizer_step())
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    assert applied == [True] * expected + [False]
    capsule = next(tmp_path.glob("*.capsule.pt"))
    again = diagnose(example(MASTER) + ":target", capsule=str(capsule))
    assert (again.step, again.top.cause.value, again.top.module) == (expected, "overflow", "attn")
    assert again.fidelity.reproduced is True and again.fidelity.tolerance == "bitwise"


def test_another_precision_for_a_pure_run_is_a_usage_error_and_the_guard_reads_the_weights():
    from typer.testing import CliRunner

    from nanprobe.surface.cli import app
    from nanprobe.live.guard import Guard
    result = CliRunner().invoke(app, ["run", example(PURE) + ":target", "--precision", "fp32"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "the weights themselves are bf16" in result.output
    model = torch.nn.Linear(3, 3).to(torch.bfloat16)
    assert Guard(model, torch.optim.SGD(model.parameters(), lr=0.1)).precision is Precision.BF16
