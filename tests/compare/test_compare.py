"""`nanprobe compare-precisions`: the same step under every precision, against an fp64 reference."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys

import pytest
import torch
from typer.testing import CliRunner

from conftest import assert_same_state, asset, example, output_lines, plain_first_bad, state_of
from nanprobe.surface.cli import app
from nanprobe.compare import CHOICES, compare_precisions, parse_precisions, plot_comparison
from nanprobe.base.config import load_config
from nanprobe.reach.entry import load_target
from nanprobe.base.errors import UsageError
from nanprobe.base.precision import Precision
from nanprobe.reach.replay import reach
from nanprobe.base.report import Phase
from nanprobe.locate.rerun import run_step

T = asset("compare_targets.py")
runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


@contextlib.contextmanager
def _isolated():
    """Module-scoped results are computed outside conftest's per-test restore: restore by hand."""
    threads, path, modules = torch.get_num_threads(), list(sys.path), set(sys.modules)
    torch.set_num_threads(1)  # tiny models: one thread is faster and steadier on a shared box
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.startswith("nanprobe_entry_"):
                del sys.modules[name]


def _compare(entry: str, **kwargs):
    with _isolated():
        return compare_precisions(entry, **kwargs)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest restores it


@pytest.fixture(scope="module")
def overflow():
    return _compare(f"{T}:overflow", at=1)


@pytest.fixture(scope="module")
def underflow():
    return _compare(f"{T}:underflow", at=1)


@pytest.fixture(scope="module")
def healthy():
    return _compare(f"{T}:healthy", at=2)


def _site(run):
    o = run.origin
    return (o.phase.value, o.module, o.op) if o else None


# -- outcomes on tiny targets -----------------------------------------------------------------------------

def test_overflow_fp16_nonfinite_at_the_attention_matmul(overflow):
    p = overflow.precisions
    assert overflow.reference == "fp64"
    assert [n for n, r in p.items() if r.ran] == ["fp64", "fp32", "bf16", "fp16", "fp16+scaler"]
    assert (p["fp64"].finite, p["fp32"].finite, p["bf16"].finite) == (True, True, True)
    assert (p["fp16"].finite, p["fp16+scaler"].finite) == (False, False)
    assert _site(p["fp16"]) == ("forward", "blocks.1.attn", "aten.bmm.default")
    assert _site(p["fp16+scaler"]) == ("forward", "blocks.1.attn", "aten.bmm.default")
    # q, k weights ~ N(0, 30^2) over 16 features: scores of ~1.7e5 in fp64, above fp16's 65504
    assert p["fp16"].would_reach > 65504 and p["fp16"].act_headroom_bits < 0
    assert p["fp16"].act_headroom_bits == pytest.approx(math.log2(65504 / p["fp16"].would_reach))
    assert p["bf16"].act_headroom_bits > 100 and p["bf16"].loss_rel_err < 0.02
    assert p["fp32"].loss_rel_err < 1e-6 and p["fp32"].grad_cosine > 1 - 1e-9
    assert p["fp16+scaler"].scaler.skipped and p["fp16+scaler"].scaler.settled_scale is None  # no scale helps
    top = overflow.closest_to_overflow[0]
    assert (top.precision, top.module) == ("fp16", "blocks.1.attn") and top.value < 0
    assert (overflow.least_accurate[0].module, overflow.least_accurate[0].value) == ("blocks.1.attn", math.inf)
    assert overflow.recommended == "bf16"
    assert overflow.recommendation.startswith("use bf16 — bf16: finite, loss within")
    assert "fp16 (with or without GradScaler): overflows in blocks.1.attn at aten.bmm.default (|x| would reach " \
           "2^17" in overflow.recommendation
    assert "keep that block in fp32 or use bf16" in overflow.recommendation
    assert overflow.exit_code == 1


def test_underflow_before_log_large_share_in_fp16_none_in_fp32(underflow):
    p = underflow.precisions
    assert _site(p["fp16"]) == ("forward", "head", "aten.log.default")
    assert p["fp16"].origin.kind == "-inf"
    assert (p["fp32"].finite, p["bf16"].finite, p["fp16"].finite) == (True, True, False)
    # softmax(30 * logits) over 64 classes: most probabilities are below fp16's smallest subnormal (6e-8)
    here, ref = p["fp16"].zeros_at_origin
    assert ref == 0 and here > 256  # of 8 x 64 inputs to the log
    assert p["fp16"].underflow_origin >= here / 512  # zero or subnormal: at least the exact zeros
    assert p["fp16"].underflow > 0.5 and p["fp16"].underflow_explains == 1.0  # every -inf comes from a flushed 0
    assert p["fp32"].underflow is None and p["bf16"].underflow < 0.01   # fp32 holds all the reference does
    assert "fp16 (with or without GradScaler): underflows before aten.log.default in head (" in underflow.recommendation
    assert "of its inputs are zero or subnormal in fp16" in underflow.recommendation
    assert underflow.recommended == "bf16" and underflow.exit_code == 1


def test_healthy_recommends_bf16_and_exits_0(healthy):
    p = healthy.precisions
    assert all(r.finite for r in p.values() if r.ran)
    assert healthy.exit_code == 0 and healthy.recommended == "bf16"
    assert p["bf16"].loss_rel_err < 0.02 and p["bf16"].grad_cosine > 0.999
    assert p["fp32"].loss_rel_err < 1e-6
    # fp64 really ran in float64: fp32 differs from it by rounding, not by zero
    assert 0 < abs(p["fp32"].loss - p["fp64"].loss) < 1e-6
    assert p["fp16+scaler"].scaler.skipped is False and p["fp16+scaler"].scaler.settled_scale == 65536.0


def test_large_bf16_error_recommends_fp32():
    cfg = load_config()
    strict = dataclasses.replace(cfg, compare=dataclasses.replace(cfg.compare, loss_tolerance=1e-6))
    cmp = _compare(f"{T}:healthy", at=2, precisions="fp32,bf16", config=strict)
    assert cmp.precisions["bf16"].loss_rel_err > 1e-6  # bf16 keeps 8 bits of mantissa
    assert cmp.recommended == "fp32" and cmp.recommendation.startswith("use fp32")


def test_gradscaler_skips_the_step_and_settles_where_the_backward_fits():
    cmp = _compare(f"{T}:scaler", at=1)
    r = cmp.precisions["fp16+scaler"]
    sc = r.scaler
    # the replay trains with a GradScaler: step 0 overflowed at 2^16, so step 1 starts at 2^15
    assert (sc.scale, sc.skipped, sc.scale_after) == (32768.0, True, 16384.0)
    assert sc.overflow.node == "MulBackward0" and sc.overflow.phase is Phase.BACKWARD
    # d loss / d out = 40 * S; the last Linear's weight grad sums 4 rows of 40 * S * tanh (|tanh| < 1):
    # 160 * S must stay below 65504 -> S <= 409 -> the first power of two is 2^8, 7 halvings from 2^15
    assert (sc.settled_scale, sc.halvings) == (256.0, 7)
    assert r.finite and r.grad_cosine > 0.9999 and r.loss_rel_err < 0.01
    assert cmp.exit_code == 0
    assert "GradScaler skips this step at 2^15 (MulBackward0 in (loss_fn) overflows) and settles at 2^8" \
        in cmp.recommendation


def test_fp64_failure_falls_back_to_an_fp32_reference():
    cmp = _compare(f"{T}:fp64_breaks", at=1, precisions="fp64,fp32,bf16")
    assert cmp.reference == "fp32"
    assert cmp.precisions["fp64"].ran is False and "fp64 rerun failed" in cmp.precisions["fp64"].note
    assert cmp.precisions["fp32"].reference and cmp.precisions["fp32"].loss_rel_err == 0.0
    assert any(n.startswith("reference is fp32: fp64 rerun failed") for n in cmp.notes)
    assert "of fp32" in cmp.recommendation and cmp.exit_code == 0


def test_subset_runs_only_those_plus_the_reference_and_notes_skips():
    cmp = _compare(f"{T}:no_optimizer", at=1, precisions="tf32,fp16+scaler,fp16")
    assert list(cmp.precisions) == ["fp64", "tf32", "fp16", "fp16+scaler"]
    assert cmp.precisions["fp16+scaler"].ran is False and "needs an optimizer" in cmp.precisions["fp16+scaler"].note
    if not torch.cuda.is_available():
        assert cmp.precisions["tf32"].ran is False and "CUDA" in cmp.precisions["tf32"].note
    assert cmp.precisions["fp16"].ran and cmp.precisions["fp16"].finite


def test_parse_precisions():
    assert parse_precisions(None) == CHOICES
    assert parse_precisions("fp16, bfloat16,FP32") == ("fp32", "bf16", "fp16")
    assert parse_precisions(["half", "fp16-scaler", "double"]) == ("fp64", "fp16", "fp16+scaler")
    with pytest.raises(UsageError, match="unknown precision 'fp8'"):
        parse_precisions("fp16,fp8")
    with pytest.raises(UsageError, match="no precision"):
        parse_precisions(" , ")


def test_top_limits_the_tables(overflow):
    assert len(overflow.least_accurate) == 8 and len(overflow.closest_to_overflow) == 8  # compare.top
    small = _compare(f"{T}:overflow", at=1, precisions="fp16", top=2)
    assert len(small.least_accurate) <= 2 and len(small.closest_to_overflow) == 2
    with pytest.raises(UsageError, match="--top 0"):
        compare_precisions(f"{T}:overflow", at=1, top=0)


# -- the user's objects -------------------------------------------------------------------------------

def test_fp64_rerun_restores_dtypes_values_and_optimizer_state():
    loaded = load_target(f"{T}:healthy")
    target = loaded.target
    reached = reach(target, at=2, precision=target.precision, cfg=load_config().replay, where=loaded.where)
    before = state_of(target)
    seen = []
    t = run_step(target, reached, Precision.FP64, where=loaded.where, instrument=True,
                 observe=lambda ph: ph is Phase.UPDATE and seen.extend(p.grad.dtype for p in target.model.parameters()))
    assert set(seen) == {torch.float64} and t.finite and not t.trace.events
    assert_same_state(target, before)
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in target.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in target.model.parameters() if p.grad is not None} <= {torch.float32}
    ref32 = run_step(target, reached, Precision.FP32, where=loaded.where, instrument=False)
    assert t.record.loss == pytest.approx(ref32.record.loss, rel=1e-6)


def test_compare_leaves_the_objects_in_the_pre_step_state_and_removes_its_hooks():
    hooks = dict(torch.nn.modules.module._global_forward_hooks)
    loaded = load_target(f"{T}:healthy")
    compare_precisions(loaded, at=2)
    fresh = load_target(f"{T}:healthy")  # same seeds: replaying it gives the expected pre-step state
    reach(fresh.target, at=2, precision=fresh.target.precision, cfg=load_config().replay, where=fresh.where)
    assert_same_state(loaded.target, state_of(fresh.target))
    assert dict(torch.nn.modules.module._global_forward_hooks) == hooks
    assert torch.get_default_dtype() == torch.float32


# -- JSON, CLI, plot --------------------------------------------------------------------------------------

def test_json_schema(overflow):
    data = json.loads(json.dumps(overflow.to_json(), allow_nan=False))
    assert data["command"] == "compare-precisions" and data["schema"] == 1 and data["step"] == 1
    assert list(data["precisions"]) == ["fp64", "fp32", "tf32", "bf16", "fp16", "fp16+scaler"]
    fp16 = data["precisions"]["fp16"]
    assert fp16["finite"] is False and fp16["loss"] == "nan" and fp16["origin"]["module"] == "blocks.1.attn"
    assert set(fp16["underflow"]) == {"gradients", "activation_gradients", "activations", "origin_inputs", "max"}
    assert data["precisions"]["fp16+scaler"]["scaler"]["skipped"] is True
    modules = [m["module"] for m in data["layers"]["modules"]]
    assert modules[0] == "emb" and "blocks.1.attn" in modules and "(model)" in modules
    assert set(data["layers"]) == {"modules", "least_accurate", "closest_to_overflow", "deepest_underflow"}
    assert data["recommendation"] == overflow.recommendation and data["recommended"] == "bf16"
    assert "underflow.gradients" in data["definitions"] and data["status"] == "nonfinite"


def test_cli_json_to_stdout_and_exit_codes():
    bad = runner.invoke(app, ["compare-precisions", f"{T}:overflow", "--at", "1", "--precisions", "fp32,fp16",
                              "--json", "-"])
    assert bad.exit_code == 1, bad.output
    data = json.loads(bad.stdout)
    assert list(data["precisions"]) == ["fp64", "fp32", "fp16"] and data["precisions"]["fp16"]["finite"] is False
    good = runner.invoke(app, ["compare-precisions", f"{T}:healthy", "--at", "2", "--precisions", "bf16",
                               "--top", "3"])
    assert good.exit_code == 0, good.output
    assert "recommendation" in good.output and "use bf16" in good.output and "Traceback" not in good.output


@pytest.mark.parametrize("args, fragment", [
    (["--precisions", "fp8"], "unknown precision 'fp8' (--precisions)"),
    (["--top", "0"], "--top 0 is not a positive count"),
    (["--plot", "ranges.py"], "cannot write a plot to ranges.py"),
    (["--at", "-1"], "--at -1 is negative"),
])
def test_cli_bad_flags_exit_2_with_one_line(args, fragment):
    result = runner.invoke(app, ["compare-precisions", f"{T}:healthy", *args])
    assert result.exit_code == 2
    lines = output_lines(result.output)
    assert len(lines) == 1 and lines[0].startswith("nanprobe: error: ") and fragment in lines[0], result.output


def test_plot_is_a_png(tmp_path, overflow):
    pytest.importorskip("matplotlib")
    out = plot_comparison(overflow, tmp_path / "ranges.png")
    data = out.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000
    cli = tmp_path / "cli.png"
    result = runner.invoke(app, ["compare-precisions", f"{T}:healthy", "--at", "1", "--precisions", "fp16",
                                 "--plot", str(cli)])
    assert result.exit_code == 0, result.output
    assert cli.read_bytes()[:8] == PNG


def test_plot_without_matplotlib_is_one_line_exit_2(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = runner.invoke(app, ["compare-precisions", f"{T}:healthy", "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 2
    lines = output_lines(result.output)
    assert lines == ["nanprobe: error: --plot needs matplotlib, which is not installed (--plot). "
                     "Install it with: pip install 'nanprobe[plot]'."]
    assert not (tmp_path / "r.png").exists()


@pytest.mark.cuda_test
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runs_tf32_and_keeps_the_overflow_site():
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    cmp = _compare(f"{T}:overflow_cuda", at=1)
    p = cmp.precisions
    assert cmp.device.startswith("cuda:0") and cmp.reference == "fp64"
    assert p["tf32"].ran and p["tf32"].finite and p["tf32"].loss_rel_err < 0.02
    assert p["bf16"].supported is torch.cuda.is_bf16_supported() and p["bf16"].finite and p["fp32"].finite
    assert p["fp16"].finite is False
    assert (p["fp16"].origin.module, p["fp16"].origin.op) == ("blocks.1.attn", "aten.bmm.default")
    assert p["fp16"].would_reach > 65504 and "overflows in blocks.1.attn" in cmp.recommendation
    assert cmp.recommended == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    loaded = load_target(f"{T}:healthy_cuda")
    with _isolated():
        healthy = compare_precisions(loaded, at=2)
    assert healthy.exit_code == 0 and healthy.recommended == "bf16"
    assert {p.dtype for p in loaded.target.model.parameters()} == {torch.float32}
    assert {v.dtype for s in loaded.target.optimizer.state.values() for k, v in s.items() if k != "step"} \
        == {torch.float32}
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags  # restored


# -- the bundled examples -----------------------------------------------------------------------------------

def test_example_fp16_attention_overflow():
    cmp = _compare(example("fp16_attention_overflow.py") + ":target")  # no --at: its first bad step
    p = cmp.precisions
    # the step |q.k| passes 65504 depends on the CPU's fp16 kernels and thread count: the plain loop's, run here
    assert cmp.step == plain_first_bad("fp16_attention_overflow.py", steps=30) and cmp.precision == "fp16"
    assert (p["fp64"].finite, p["fp32"].finite, p["bf16"].finite) == (True, True, True)
    assert (p["fp16"].finite, p["fp16+scaler"].finite) == (False, False)
    assert _site(p["fp16"]) == ("forward", "blocks.0.attn", "aten.bmm.default")
    # the example: one entry of q @ k^T grows 1.3-2x a step and passes fp16's 65504 at this step
    assert 65504 < p["fp16"].would_reach < 2 * 65504 and p["fp16"].act_headroom_bits < 0
    assert "fp16 (with or without GradScaler): overflows in blocks.0.attn at aten.bmm.default (|x| would reach " \
           "2^16" in cmp.recommendation
    assert p["fp16+scaler"].scaler.skipped and p["fp16+scaler"].scaler.settled_scale is None
    assert cmp.exit_code == 1


def test_example_fp16_underflow_log():
    cmp = _compare(example("fp16_underflow_log.py") + ":target", at=2)
    p = cmp.precisions
    assert _site(p["fp16"]) == ("forward", "head", "aten.log.default") and p["fp16"].origin.samples == (3,)
    # one of the 16 samples (sample 3: logit ~ -19, sigmoid 5.6e-9 in fp64) flushes to exactly 0 in fp16 (and
    # 1e-8 is 0 there too): 1/16 of the log's inputs underflow, and that input is every -inf the log makes
    assert p["fp16"].zeros_at_origin == (1, 0)
    assert p["fp16"].underflow_origin == pytest.approx(1 / 16) and p["fp16"].underflow_explains == 1.0
    assert p["fp16"].underflow >= 1 / 16
    assert p["fp32"].finite and p["fp32"].underflow is None and p["bf16"].finite   # not measured for fp32
    assert "underflows before aten.log.default in head (6.2% of its inputs are zero or subnormal in fp16; they " \
           "feed 100% of its non-finite outputs)" in cmp.recommendation
    assert cmp.recommended == "bf16" and cmp.exit_code == 1


def test_example_healthy_transformer_recommends_bf16():
    cmp = _compare(example("healthy_transformer.py") + ":target", at=4)
    assert cmp.exit_code == 0 and cmp.recommended == "bf16"
    assert all(r.finite for r in cmp.precisions.values() if r.ran)
    assert cmp.precisions["bf16"].loss_rel_err < 0.02 and cmp.precisions["bf16"].grad_cosine > 0.999
    # without a loss scale, fp16 flushes a share of the small gradients; GradScaler's 2^16 keeps them
    assert cmp.precisions["fp16"].underflow_grads > cmp.precisions["fp16+scaler"].underflow_grads
