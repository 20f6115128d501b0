"""Never wrong, never destructive: exit codes, the caller's global state, the Guard's files, damaged
capsules, pure JSON, the user's own debugging setup, endless data, and ~50 bad inputs."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import asset, example
from nanprobe import diagnose, scan_data, smoke
from nanprobe.capsule import list_capsules
from nanprobe.surface.cli import app
from nanprobe.compare import compare_precisions
from nanprobe.reach.entry import load_target
from nanprobe.live.guard import Guard
from nanprobe.testing import assert_trains_finite

H = asset("hostile.py")
T = asset("tiny.py")
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _lines(result) -> list[str]:
    return [line for line in result.output.strip().splitlines() if line.strip()]


# -- ~50 bad inputs: exit 2, at most 3 lines, no traceback --------------------------------------------------

BAD = [
    # the CLI's own parsing
    (["run", "--foo"], "no such option: --foo"),
    (["bogus"], "no such command 'bogus'"),
    (["run"], "missing argument 'ENTRY'"),
    (["run", f"{T}:target", "--at", "abc"], "invalid value for '--at'"),
    (["smoke", f"{T}:target", "--steps"], "requires an argument"),
    (["scan-data", f"{T}:target", "--limit", "x"], "invalid value for '--limit'"),
    (["compare-precisions"], "missing argument 'ENTRY'"),
    (["run", f"{T}:target", "extra-arg"], "unexpected extra argument"),
    # ENTRY
    (["run", "nope.py:target"], "not found"),
    (["run", "no_colon"], "names no function"),
    (["run", "x.py:1bad"], "not a Python name"),
    (["run", "no_such_pkg_xyz.mod:target"], "not found"),
    (["run", f"{T}:missing"], "no function 'missing'"),
    (["run", asset("syntax_error.py") + ":target"], "syntax_error.py:1"),
    (["run", asset("import_error.py") + ":target"], "ModuleNotFoundError"),
    (["run", f"{T}:raises"], "KeyError"),
    (["run", f"{T}:returns_none"], "not a nanprobe.Target or dict"),
    (["run", f"{T}:no_model"], "returned no 'model'"),
    (["run", f"{T}:takes_two"], "required arguments"),
    # the target's contract
    (["run", f"{H}:epochs_zero"], "'epochs' is 0"),
    (["run", f"{H}:accumulate_bad"], "'accumulate' is -2"),
    (["run", f"{H}:step_and_loss"], "both 'loss_fn' and 'step_fn'"),
    (["run", f"{H}:step_fn_not_callable"], "'step_fn' is int"),
    (["run", f"{H}:optimizer_list_bad"], "not parameters of 'model'"),
    (["run", f"{H}:grad_scaler_with_step_fn"], "'grad_scaler' is True with 'step_fn'"),
    (["run", f"{H}:max_grad_norm_with_step_fn"], "'max_grad_norm' is set with 'step_fn'"),
    (["run", f"{H}:one_shot"], "one-shot iterator"),
    (["run", f"{H}:ignore_index_bad"], "'ignore_index' is 'x'"),
    (["run", f"{H}:scheduler_on_skip_bad"], "'scheduler_on_skip' is 'yes'"),
    (["run", f"{H}:grad_scaler_object_bad"], "not a torch.amp.GradScaler or bool"),
    (["run", f"{H}:step_fn_bad_return"], "not a scalar"),
    (["run", f"{T}:loss_not_scalar"], "not a scalar"),
    (["run", f"{T}:loss_not_tensor"], "not a tensor"),
    (["run", f"{T}:loss_raises"], "RuntimeError"),
    # the user's code exits
    (["run", f"{H}:exits_0"], "your code called sys.exit(0) in loss_fn(model, batch) during step 2"),
    (["run", f"{H}:exits_1"], "your code called sys.exit(1)"),
    (["smoke", f"{H}:exits_0", "--steps", "5"], "sys.exit(0)"),
    (["run", f"{H}:exits_at_import_time"], "sys.exit(3) in exits_at_import_time()"),
    # nothing checked is never healthy
    (["run", f"{H}:empty"], "yielded no batch"),
    (["smoke", f"{H}:empty", "--steps", "3"], "data ended after 0 steps"),
    (["scan-data", f"{H}:empty"], "yielded no batch"),
    (["compare-precisions", f"{H}:empty"], "yielded no batch"),
    (["run", f"{T}:target", "--max-steps", "0"], "--max-steps 0"),
    (["run", f"{T}:target", "--max-steps", "-5"], "--max-steps -5"),
    (["smoke", f"{T}:target", "--steps", "0"], "--steps 0"),
    (["smoke", f"{T}:target", "--steps", "50"], "data ended after 5 steps"),
    (["run", f"{T}:target", "--at", "8", "--max-steps", "4"], "--at 8 is beyond --max-steps 4"),
    # flags
    (["run", f"{T}:target", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["run", f"{T}:target", "--at", "-1"], "negative"),
    (["run", f"{T}:target", "--autocast-policy", "tpu"], "unknown autocast policy"),
    (["run", f"{T}:target", "--capsule", "/no/such/capsule.pt"], "not found"),
    (["scan-data", f"{T}:target", "--limit", "-3"], "--limit -3"),
    (["scan-data", f"{T}:target", "--num-classes", "0"], "--num-classes 0"),
    (["compare-precisions", f"{T}:target", "--precisions", "fp8"], "fp8"),
    (["compare-precisions", f"{T}:target", "--top", "0"], "--top 0"),
    (["compare-precisions", f"{T}:target", "--plot", "out.txt"], "cannot write a plot"),
]


@pytest.mark.parametrize("args, fragment", BAD, ids=[" ".join(a[:1] + [a[1].rsplit("/", 1)[-1]] if len(a) > 1
                                                               else a) + f"#{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_exits_2_in_at_most_3_lines_without_a_traceback(args, fragment):
    result = invoke(*args)
    lines = _lines(result)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert 1 <= len(lines) <= 3, result.output
    assert lines[0].startswith("nanprobe: error: ") and fragment in result.output, result.output


def test_the_table_covers_at_least_40_inputs():
    assert len(BAD) >= 40


# -- interrupts -------------------------------------------------------------------------------------------

def test_interrupt_exits_130_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "report.json"
    result = invoke("run", f"{H}:interrupted", "--json", str(out))
    assert result.exit_code == 130
    assert _lines(result) == ["nanprobe: interrupted (nothing was written)."]
    assert not out.exists() and not list(tmp_path.iterdir())


# -- --json - carries only JSON ------------------------------------------------------------------------------

def test_json_to_stdout_is_pure_json_when_the_users_code_prints():
    result = invoke("run", f"{H}:prints", "--json", "-")
    assert result.exit_code == 0
    data = json.loads(result.stdout)          # nothing but the report on stdout
    assert data["status"] == "finite"
    assert "loss_fn says hello" in result.stderr and "building the model" in result.stderr


# -- endless data --------------------------------------------------------------------------------------------

def test_scan_data_bounds_an_iterable_without_length_and_says_so():
    from nanprobe.base.config import load_config
    import dataclasses

    cfg = load_config()
    cfg = dataclasses.replace(cfg, scan=dataclasses.replace(cfg.scan, callable_batches=25))
    result = scan_data(f"{H}:endless", config=cfg)
    assert result.batches_scanned == 25 and not result.complete
    assert any("no length" in n and "--limit" in n for n in result.notes)
    assert scan_data(f"{H}:endless", limit=7).batches_scanned == 7


# -- the caller's global state -----------------------------------------------------------------------------

def _globals() -> dict:
    return {
        "torch_rng": torch.get_rng_state().clone(), "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].copy(), "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "autocast": torch.is_autocast_enabled("cpu"), "autocast_dtype": torch.get_autocast_dtype("cpu"),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }


def _same(a: dict, b: dict) -> None:
    for k in a:
        va, vb = a[k], b[k]
        same = torch.equal(va, vb) if isinstance(va, torch.Tensor) else \
            bool((va == vb).all()) if isinstance(va, np.ndarray) else va == vb
        assert same, k


CALLS = {
    "diagnose": lambda tmp: diagnose(example("div_l2norm_no_eps.py") + ":target"),
    "diagnose --at": lambda tmp: diagnose(example("healthy_mlp.py") + ":target", at=3),
    "compare_precisions": lambda tmp: compare_precisions(example("fp16_underflow_log.py") + ":target", at=2),
    "scan_data": lambda tmp: scan_data(example("data_nan_features.py") + ":target"),
    "smoke": lambda tmp: smoke(example("div_l2norm_no_eps.py") + ":target", steps=6, capsule_dir=tmp),
    "assert_trains_finite": lambda tmp: assert_trains_finite(example("healthy_mlp.py") + ":target", steps=4),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_library_calls_give_back_every_global_they_touch(name, tmp_path):
    torch.manual_seed(1234)
    random.seed(5)
    np.random.seed(6)
    torch.set_num_threads(1)
    before = _globals()
    CALLS[name](tmp_path)
    _same(before, _globals())


def test_capsule_replay_gives_back_the_thread_count(tmp_path):
    smoke(example("div_l2norm_no_eps.py") + ":target", steps=6, capsule_dir=tmp_path)
    (capsule,) = list_capsules(tmp_path)
    torch.set_num_threads(1)
    before = _globals()
    diagnose(example("div_l2norm_no_eps.py") + ":target", capsule=str(capsule))
    _same(before, _globals())


def test_compare_keeps_parameter_identity_storage_views_and_param_groups():
    loaded = load_target(example("fp16_underflow_log.py") + ":target")
    t = loaded.target
    params = [(p, p.data_ptr()) for p in t.model.parameters()]
    view = next(t.model.parameters()).view(-1)     # a view the user holds
    groups = [id(g) for g in t.optimizer.param_groups]
    flags = [m.training for m in t.model.modules()]
    compare_precisions(loaded, at=2)
    assert [(p, p.data_ptr()) for p in t.model.parameters()] == params
    assert [id(g) for g in t.optimizer.param_groups] == groups
    assert [m.training for m in t.model.modules()] == flags
    with torch.no_grad():
        next(t.model.parameters()).add_(1.0)
    assert torch.equal(view, next(t.model.parameters()).view(-1))   # the view still tracks the weights


def _key(report):
    top = report.top
    return report.step, report.status, report.origin, top.cause, top.phase, top.module


def test_the_users_anomaly_mode_and_no_grad_do_not_change_the_diagnosis():
    entry = example("sqrt_grad_at_zero.py") + ":target"
    plain = diagnose(entry)
    with torch.autograd.set_detect_anomaly(True):
        under_anomaly = diagnose(entry)
        assert torch.is_anomaly_enabled()
    with torch.no_grad():
        under_no_grad = diagnose(entry)
        assert not torch.is_grad_enabled()
    assert _key(plain) == _key(under_anomaly) == _key(under_no_grad)


# -- the Guard never deletes what it did not write -------------------------------------------------------------

def _nan_run(guard, t, steps=14):
    from nanprobe.base.batch import map_tensors

    for i, batch in enumerate(t.batches[:steps]):
        if i % 2 == 1:   # every other batch poisoned: the guard skips and capsules each of them
            batch = map_tensors(batch, lambda x: x * float("nan") if x.is_floating_point() else x)
        with guard.step(batch):
            t.optimizer.zero_grad(set_to_none=True)
            guard.backward(t.loss_fn(t.model, batch))
        guard.optimizer_step()


def test_guard_with_a_tampered_state_deletes_only_its_own_capsules(tmp_path, caplog):
    folder = tmp_path / "caps"
    folder.mkdir()
    precious = tmp_path / "thesis.pt"
    precious.write_bytes(b"years of work")
    decoy = folder / "step0000001-rank0-20260101T000000-1.capsule.pt"   # a capsule's name, not a capsule
    decoy.write_bytes(b"not a capsule")
    t = load_target(example("healthy_mlp.py") + ":target").target
    guard = Guard(t.model, t.optimizer, capsule_dir=folder, config={"max_capsules": 2, "max_consecutive_skips": 99})
    state = guard.state_dict()
    state["capsules"] = [str(precious), str(decoy), "../../etc/passwd"]
    with caplog.at_level(logging.WARNING, logger="nanprobe.guard"):
        guard.load_state_dict(state)
    assert sum("ignoring" in r.message for r in caplog.records) == 3
    _nan_run(guard, t)
    assert precious.read_bytes() == b"years of work" and decoy.read_bytes() == b"not a capsule"
    assert len(list_capsules(folder)) == 3   # the decoy + the guard's first and newest (max_capsules 2)
    assert len(guard.events) >= 4


# -- damaged capsules ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_capsule(tmp_path_factory):
    folder = tmp_path_factory.mktemp("caps")
    smoke(example("div_l2norm_no_eps.py") + ":target", steps=6, capsule_dir=folder)
    (path,) = list_capsules(folder)
    return path


@pytest.mark.parametrize("field, value", [
    ("rng", {"torch": "garbage"}),
    ("micro_rng", [{"torch": torch.zeros(0)}]),
    ("micro_batches", [{"__nanprobe__": "martian"}]),
    ("position", {"epoch": "x", "index": "y"}),
    ("carried", ["not", "a", "dict"]),
    ("optimizers", "nope"),
    ("history", "nope"),
])
def test_a_damaged_capsule_field_exits_2_naming_the_field(good_capsule, tmp_path, field, value):
    data = torch.load(good_capsule, weights_only=True)
    data[field] = value
    bad = tmp_path / good_capsule.name
    torch.save(data, bad)
    result = invoke("run", example("div_l2norm_no_eps.py") + ":target", "--capsule", bad)
    assert result.exit_code == 2, result.output
    assert len(_lines(result)) == 1 and "Traceback" not in result.output
    assert repr(field) in result.output or field in result.output


def _tensor_nodes(x):
    if isinstance(x, dict):
        if x.get("__nanprobe__") == "tensor":
            yield x
        for v in x.values():
            yield from _tensor_nodes(v)
    elif isinstance(x, list):
        for v in x:
            yield from _tensor_nodes(v)


def _first_state(data):
    return next(iter(data["optimizers"][0]["state"].values()))


# (what is damaged, how, the field the one line names, what it says)
DAMAGED = [
    ("torch RNG of the wrong size", lambda d: d["rng"].update(torch=torch.zeros(100, dtype=torch.uint8)),
     "'rng'", "holds 100 uint8 values"),
    ("Python RNG that is no state vector", lambda d: d["rng"].update(python=[3, [1, 2, 3], None]), "'rng'",
     "not 625 integers"),
    ("micro-batch RNG of the wrong size", lambda d: d.update(micro_rng=[{"torch": torch.zeros(5, dtype=torch.uint8)}]),
     "'micro_rng[0]'", "holds 5 uint8"),
    ("a batch tensor that is a string", lambda d: next(_tensor_nodes(d["micro_batches"])).update(data="hello"),
     "'micro_batches'", "holds a str, not a tensor"),
    ("a micro-batch that is a string", lambda d: d["micro_batches"].__setitem__(0, "garbage"), "'micro_batches'",
     "is a str"),
    ("Adam state of another shape", lambda d: _first_state(d).update(exp_avg=_first_state(d)["exp_avg"][:1]),
     "'optimizers'", "has shape (1, 200), the parameter (32, 200)"),
    ("Adam step that is not a number", lambda d: _first_state(d).update(step=torch.zeros(3)), "'optimizers'", "not a number"),
]


@pytest.mark.parametrize("how, names, says", [d[1:] for d in DAMAGED], ids=[d[0] for d in DAMAGED])
def test_a_damaged_capsule_value_exits_2_naming_the_field(good_capsule, tmp_path, how, names, says):
    data = torch.load(good_capsule, weights_only=True)
    how(data)
    bad = tmp_path / good_capsule.name
    torch.save(data, bad)
    result = invoke("run", example("div_l2norm_no_eps.py") + ":target", "--capsule", bad)
    assert result.exit_code == 2, result.output
    assert len(_lines(result)) == 1 and "Traceback" not in result.output and "internal error" not in result.output
    assert f"capsule field {names} is damaged" in result.output and says in result.output, result.output


@pytest.mark.parametrize("keep", [2000, 0.5, -30, -1])
def test_a_truncated_capsule_says_truncated_with_sizes(good_capsule, tmp_path, keep):
    whole = good_capsule.read_bytes()
    cut = keep if isinstance(keep, int) and keep > 0 else int(len(whole) * keep) if isinstance(keep, float) \
        else len(whole) + keep
    bad = tmp_path / good_capsule.name
    bad.write_bytes(whole[:cut])
    result = invoke("run", example("div_l2norm_no_eps.py") + ":target", "--capsule", bad)
    assert result.exit_code == 2 and len(_lines(result)) == 1, result.output
    assert f"file is truncated: " in result.output and f"{cut:,} bytes" in result.output, result.output
    if keep == 0.5:   # past the pickle: the tensors it lists say how large the file must at least be
        needed = int(result.output.split("alone need ")[1].split(" ")[0].rstrip(".").replace(",", ""))
        assert cut < needed <= len(whole)


def test_a_capsule_from_a_newer_nanprobe_and_torch_warns(good_capsule, tmp_path):
    data = torch.load(good_capsule, weights_only=True)
    data["versions"] = dict(data["versions"], nanprobe="99.0.0", torch="9.9.0")
    newer = tmp_path / good_capsule.name
    torch.save(data, newer)
    report = diagnose(example("div_l2norm_no_eps.py") + ":target", capsule=str(newer))
    warnings = [n for n in report.notes if n.startswith("warning:")]
    assert len(warnings) == 2 and "nanprobe 99.0.0" in warnings[0] and "torch 9.9.0" in warnings[1]


def test_library_sys_exit_is_an_error_not_an_exit():
    from nanprobe.base.errors import UserExit

    with pytest.raises(UserExit) as info:
        diagnose(f"{H}:exits_0")
    assert info.value.exit_code == 2 and info.value.step == 2
    assert "sys.exit(0)" in info.value.message and "hostile.py" in info.value.message


# -- every bad step gets a finding; progress in CI logs --------------------------------------------------------

def test_a_nan_constant_in_the_code_gets_a_finding_with_its_origin():
    """No op produces the NaN (the loss is multiplied by float('nan')): the answer is still a finding, at the op
    where the value enters, with the user's line, a low confidence and the raw facts."""
    report = diagnose(f"{H}:nan_constant")
    top = report.top
    assert (report.step, report.exit_code) == (3, 1)
    assert (top.cause.value, top.phase.value, top.op) == ("unknown", "forward", "aten.mul.Tensor"), top
    assert top.confidence < 0.5 and report.origin is not None and report.origin.op == "aten.mul.Tensor"
    assert report.origin.source.rsplit(":", 1)[0].endswith("hostile.py") and "float(\"nan\")" in report.origin.code
    text = "\n".join(top.evidence)
    assert "no op of the step produced it" in text and "loss nan" in text
    assert [f.title.split(" ")[0] for f in top.fixes] == ["Find", "Skip"]


def test_progress_lines_on_stderr_without_a_terminal_and_pure_json_on_stdout(tmp_path):
    cfg = tmp_path / "fast.yaml"
    cfg.write_text("run:\n  progress_every: 0.01\n")
    result = invoke("run", f"{H}:endless", "--at", "30", "--config", cfg, "--json", "-")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step"] == 30
    lines = [line for line in result.stderr.splitlines() if line.startswith("nanprobe: replayed step")]
    assert lines and all(line.endswith(" s)") for line in lines), result.stderr
