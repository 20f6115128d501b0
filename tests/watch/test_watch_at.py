"""`nanprobe watch --at N -- python train.py`: the script re-executed with step N instrumented.

Every expected step comes from running the plain script in the same test (or from the watched run itself
where the script draws it from an unseeded generator), never from a number measured on one machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import first_nonfinite_update
from nanprobe.surface.cli import app
from nanprobe.watch import watch
from nanprobe.watch.at import watch_at
from nanprobe.watch.record import RUN_SUFFIX, read_run_record

WATCH = Path(__file__).resolve().parents[1] / "assets" / "watch"
SQRT = WATCH / "sqrt_backward.py"
EPS_ZERO = WATCH / "eps_zero.py"
CRITERION = WATCH / "criterion.py"
SQRT_LINE = next(i + 1 for i, text in enumerate(SQRT.read_text().splitlines()) if "torch.sqrt(" in text)
LOG_LINE = next(i + 1 for i, text in enumerate(CRITERION.read_text().splitlines())
                if "counts * torch.log(rate)" in text)
runner = CliRunner()


def _plain(script: Path, *args: str) -> str:
    """The script run as `python script.py ARGS` would (in this process, no nanprobe): its stdout."""
    out = io.StringIO()
    argv, path0 = list(sys.argv), sys.path[0]
    sys.argv, sys.path[0] = [str(script), *args], str(script.parent)
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[0] = argv, path0
    return out.getvalue()


def _first(stdout: str, pattern: str) -> int:
    return min(int(m.group(1)) for m in re.finditer(pattern, stdout))


def _first_nonfinite_update(*args: str) -> int:
    """The first step after whose optimizer update a weight of the plain script is non-finite."""
    return first_nonfinite_update(lambda: _plain(EPS_ZERO, *args))


def _json(path) -> dict:
    return json.loads(Path(path).read_text())


def test_watch_at_arms_a_functional_model_at_the_end_of_the_step_before(tmp_path, capsys):
    """A model whose forward is never called (a GAN written with methods and free tensors): watch catches the
    step but has no root module to rerun, and --at had no forward to arm at ("not instrumented"). It now arms
    when step N-1's update ends, over the optimizer's parameters, and finds the log of an exact 0 in forward."""
    script = WATCH / "functional_log.py"
    result = watch(["python", str(script)], dirpath=tmp_path)
    out = capsys.readouterr().out
    expected = _first(out, r"step (\d+) loss (?:inf|nan)")
    bad = result.events[0]
    command = f"nanprobe watch --at {expected} --dir {tmp_path} -- python {script}"
    assert bad.step == expected and _json(bad.report)["origin"] is None and command in bad.headline, bad
    at = watch_at(["python", str(script)], expected, dirpath=tmp_path)
    capsys.readouterr()
    data = at.report.to_json()
    line = next(i + 1 for i, text in enumerate(script.read_text().splitlines()) if "torch.log(1 - p)" in text)
    assert at.reproduced is True and data["origin"]["op"] == "aten.log.default", data["origin"]
    assert data["origin"]["phase"] == "forward" and data["origin"]["source"].endswith(f"functional_log.py:{line}")
    assert data["findings"][0]["cause"] == "log", data["findings"][0]


def test_watch_at_tells_an_fp16_underflow_from_a_log_of_zero(tmp_path, capsys):
    """There is no fp32 reference rerun of the script's own step: the op that made the log's exact 0 (fp16's
    softmax) is recomputed in float32, where that probability is 9e-14, not 0. Cause underflow, as run says,
    not log (which the same report said before)."""
    script = WATCH / "fp16_logprob.py"
    expected = _first(_plain(script), r"step (\d+) loss \S+ grads nan")
    capsys.readouterr()
    watch(["python", str(script)], dirpath=tmp_path)
    at = watch_at(["python", str(script)], expected, dirpath=tmp_path)
    capsys.readouterr()
    data = at.report.to_json()
    assert (data["origin"]["op"], data["origin"]["phase"]) == ("aten.log.default", "forward"), data["origin"]
    top = data["findings"][0]
    assert top["cause"] == "underflow" and any("non-zero in fp32" in e for e in top["evidence"]), top
    assert data["findings"][1]["cause"] == "log"   # the secondary: what the zero did


def test_watch_at_locates_a_nan_born_in_backward_that_watch_alone_does_not(tmp_path, capsys):
    expected = _first(_plain(SQRT), r"step (\d+) loss \S+ grads nan")
    capsys.readouterr()
    result = watch(["python", str(SQRT)], dirpath=tmp_path)
    capsys.readouterr()
    bad = result.events[0]
    first = _json(bad.report)
    # watch alone: the right step, no origin; the line and the report name the command that locates it
    command = f"nanprobe watch --at {expected} --dir {tmp_path} -- python {SQRT}"
    assert (bad.step, first["origin"]) == (expected, None)
    assert command in bad.headline and f"not located in-process: {command}" in first["notes"][0]
    assert first["watch"]["at"]["command"] == command
    run = read_run_record(Path(first["watch"]["at"]["run_record"]))
    assert run["argv"] == [str(SQRT)] and [b["step"] for b in run["bad_steps"]] == [expected]
    assert run["bad_steps"][0]["record"]["grad_norm"] == "nan" and run["skipped"] == [expected]

    at = watch_at(["python", str(SQRT)], expected, dirpath=tmp_path, json_out=tmp_path / "at.json")
    out = capsys.readouterr().out
    assert f"step {expected - 1} loss" in out and f"step {expected} loss" not in out   # stopped after step N
    report = _json(tmp_path / "at.json")
    assert report == _json(at.path)
    origin, top = report["origin"], report["findings"][0]
    assert (report["command"], report["step"], report["status"]) == ("watch", expected, "nonfinite")
    assert (origin["phase"], origin["module"], origin["node"], origin["kind"]) == \
        ("backward", "distance", "SqrtBackward0", "nan")
    assert origin["source"].endswith(f"sqrt_backward.py:{SQRT_LINE}")
    assert (top["cause"], top["phase"], top["module"]) == ("sqrt", "backward", "distance")
    assert report["fidelity"]["reproduced"] is True and at.exit_code == 1
    assert all(f["verified"] is None for f in top["fixes"]) and top["fixes"]
    assert any(n.startswith("fixes not verified") and f"nanprobe run ENTRY --at {expected}" in n
               for n in report["notes"])


@pytest.mark.parametrize("flag", [(), ("--optimizer-flag", "fused")], ids=["for-loop", "fused"])
def test_watch_at_locates_a_nan_born_in_the_optimizer_update(tmp_path, flag):
    expected = _first_nonfinite_update(*flag)
    result = watch(["python", str(EPS_ZERO), *flag], dirpath=tmp_path)
    assert result.events[0].step == expected
    at = watch_at(["python", str(EPS_ZERO), *flag], expected, dirpath=tmp_path)
    report = at.report.to_json()
    origin, top = report["origin"], report["findings"][0]
    assert (report["step"], origin["phase"], origin["module"], origin["parameter"]) == \
        (expected, "update", "kind", "kind.weight")
    assert (top["cause"], top["phase"]) == ("div", "update")
    assert report["fidelity"]["reproduced"] is True
    assert report["fidelity"]["replayed"]["weights_nonfinite"] is True


def test_watch_at_locates_a_nan_born_in_a_criterion_module_outside_the_model(tmp_path, capsys):
    expected = _first(_plain(CRITERION), r"step (\d+) loss nan")
    capsys.readouterr()
    result = watch(["python", str(CRITERION)], dirpath=tmp_path)
    first = _json(result.events[0].report)   # watch alone: the op from the autograd graph, no source line
    assert first["origin"]["module"] == "(loss outside the model)" and first["origin"]["source"] is None
    assert any(f"nanprobe watch --at {expected} --dir {tmp_path} -- python {CRITERION}" in n for n in first["notes"])
    at = watch_at(["python", str(CRITERION)], expected, dirpath=tmp_path)
    report = at.report.to_json()
    origin, top = report["origin"], report["findings"][0]
    assert (report["step"], origin["phase"], origin["module"], origin["op"]) == \
        (expected, "forward", "(loss outside the model: PoissonNLL)", "aten.log.default")
    assert origin["source"].endswith(f"criterion.py:{LOG_LINE}") and origin["samples"]
    assert (top["cause"], top["phase"]) == ("log", "forward")
    assert report["fidelity"]["reproduced"] is True


def test_watch_at_repeats_the_updates_watch_skipped_before_the_step(tmp_path, capsys):
    """A later bad step (beyond --max-reports: no report, a line): the updates watch skipped before it are
    skipped again, so the rerun reaches the same state."""
    result = watch(["python", str(CRITERION)], dirpath=tmp_path)
    skipped = [e.step for e in result.events if e.action == "skipped"]
    last = result.events[-1]
    assert len(skipped) >= 2 and last.report is None and skipped[0] < last.step
    at = watch_at(["python", str(CRITERION)], last.step, dirpath=tmp_path)
    data = at.report.to_json()
    assert at.reproduced is True and data["fidelity"]["reproduced"] is True and data["step"] == last.step
    assert data["status"] == last.status and data["origin"] is not None
    assert _json(at.path)["watch"]["skipped_before"] == [s for s in skipped if s < last.step]


def test_watch_at_restores_python_random_and_numpy_of_the_watched_run(tmp_path, capsys):
    """The bad step and the inputs' noise come from unseeded random/numpy: only their start state repeats it."""
    result = watch(["python", str(SQRT), "--random"], dirpath=tmp_path)
    step = _first(capsys.readouterr().out, r"step (\d+) loss \S+ grads nan")   # the watched run's own
    assert result.events[0].step == step
    at = watch_at(["python", str(SQRT), "--random"], step, dirpath=tmp_path)
    report = at.report.to_json()
    assert report["fidelity"]["reproduced"] is True
    assert (report["origin"]["phase"], report["origin"]["module"], report["findings"][0]["cause"]) == \
        ("backward", "distance", "sqrt")
    assert {"python random", "numpy"} <= set(_json(at.path)["watch"]["restored"])
    # without the start state the rerun draws other values: said plainly, never a diagnosis
    for p in tmp_path.glob(f"*{RUN_SUFFIX}"):
        header, *lines = p.read_text().splitlines()
        p.write_text("\n".join([json.dumps({k: v for k, v in json.loads(header).items() if k != "start_state"}),
                                *lines]) + "\n")
    again = watch_at(["python", str(SQRT), "--random"], step, dirpath=tmp_path)
    data = again.report.to_json()
    assert again.reproduced is False and data["origin"] is None
    assert [f["cause"] for f in data["findings"]] == ["not_reproduced"]
    assert data["notes"][0].startswith("not reproduced: ")
    assert any("start state" in n for n in data["notes"])


def test_watch_at_says_not_reproduced_when_the_script_does_not_repeat_itself(tmp_path, capsys):
    marker = tmp_path / "marker"
    result = watch(["python", str(SQRT), "--marker", str(marker)], dirpath=tmp_path)
    step = result.events[0].step
    at = watch_at(["python", str(SQRT), "--marker", str(marker)], step, dirpath=tmp_path)
    data = at.report.to_json()
    assert at.reproduced is False and at.exit_code == 1 and data["origin"] is None
    assert [f["cause"] for f in data["findings"]] == ["not_reproduced"]
    assert data["notes"][0].startswith(f"not reproduced: at step {step} the rerun differs from the watched run: ")
    assert "grad norm nan in the watched run" in data["notes"][0]
    assert data["fidelity"]["reproduced"] is False
    # a step the script never reaches
    far = watch_at(["python", str(SQRT)], 50, dirpath=tmp_path / "none")
    assert far.reproduced is False and far.report.notes[0] == \
        "not reproduced: the script ended after 8 optimizer step(s), before step 50 ended"


def test_watch_cli_at_and_explain(tmp_path):
    """By default watch explains a step it did not locate in-process by re-executing the script to it, and
    its --json is that explained report; over watch.explain_budget it says how long that would take and
    gives the command; --no-explain never re-executes."""
    expected = _first(_plain(SQRT), r"step (\d+) loss \S+ grads nan")
    reports = tmp_path / "reports"
    out = tmp_path / "watch.json"
    res = runner.invoke(app, ["watch", "--dir", str(reports), "--json", str(out), "--", "python", str(SQRT)])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("nanprobe watch: step") and "re-executed" in x)
    assert line.startswith(f"nanprobe watch: step {expected} was not located in-process, so the script "
                           f"was re-executed with step {expected} instrumented (nanprobe watch --at {expected} "
                           f"--dir {reports} -- python {SQRT}): origin in backward, module distance, SqrtBackward0, "
                           "cause sqrt")
    # the explained report is shown here; what the script printed again went to a file, not to the screen
    log = reports / f"at-step{expected:07d}-output.log"
    assert line.endswith(f"; the script's output this time: {log}")
    assert f"nanprobe watch: step {expected}: non-finite values born in backward" in res.output
    assert f"step {expected - 1} loss" in log.read_text() and "nanprobe watch --at" in log.read_text()
    explained = _json(next(reports.glob(f"at-step{expected:07d}-*.json")))
    assert (explained["origin"]["phase"], explained["findings"][0]["cause"]) == ("backward", "sqrt")
    data = _json(out)   # the --json report is the explained one, and says how it was made
    assert (data["origin"]["node"], data["findings"][0]["cause"]) == ("SqrtBackward0", "sqrt")
    assert data["watch_explained"]["command"] == f"nanprobe watch --at {expected} --dir {reports} -- python {SQRT}"
    assert data["watch_explained"]["in_process_report"] and data["watch_explained"]["seconds_to_reach"] >= 0
    budget = tmp_path / "budget.yaml"
    budget.write_text("watch:\n  explain_budget: 0.0\n")
    res = runner.invoke(app, ["watch", "--dir", str(tmp_path / "r2"), "--config", str(budget), "--", "python",
                              str(SQRT)])
    assert res.exit_code == 0 and "re-executed" not in res.output, res.output
    assert f"re-executing the script to it would take about" in res.output
    assert f"over watch.explain_budget (0 s): nanprobe watch --at {expected}" in res.output
    res = runner.invoke(app, ["watch", "--no-explain", "--dir", str(tmp_path / "r3"), "--", "python", str(SQRT)])
    assert res.exit_code == 0 and "re-execut" not in res.output, res.output
    res = runner.invoke(app, ["watch", "--at", str(expected), "--dir", str(reports), "--json",
                              str(tmp_path / "at.json"), "--", "python", str(SQRT)])
    assert res.exit_code == 1, res.output
    assert _json(tmp_path / "at.json")["origin"]["node"] == "SqrtBackward0"
    res = runner.invoke(app, ["watch", "--at", "-1", "--", "python", str(SQRT)])
    assert res.exit_code == 2
    # a launcher's ranks are not re-executed: one line, exit 2, the capsule replay named instead
    for launcher in (["torchrun", "--nproc-per-node", "2"], ["python", "-m", "torch.distributed.run"]):
        res = runner.invoke(app, ["watch", "--at", "1", "--", *launcher, str(SQRT)])
        assert res.exit_code == 2 and "re-executes one Python process" in res.output, res.output
        assert "nanprobe run ENTRY --capsule" in res.output


def test_watch_at_counts_gradscaler_skips_as_watch_does(tmp_path):
    """fp16 autocast + GradScaler that skips every step: the step watch names is the step --at instruments."""
    script = WATCH / "scaler_storm.py"
    result = watch(["python", str(script)], dirpath=tmp_path)
    step = result.events[0].step
    at = watch_at(["python", str(script)], step, dirpath=tmp_path)
    data = at.report.to_json()
    assert at.reproduced is True and data["step"] == step and data["precision"] == "fp16"
    assert data["fidelity"]["replayed"]["skipped"] is True   # the scaler skipped it in the watched run too
    assert (data["origin"]["phase"], data["findings"][0]["cause"]) == ("backward", "overflow")
    assert any(n.startswith(f"GradScaler skipped the update of step {step}") for n in data["notes"])


def test_watch_at_explains_a_step_where_the_script_raised_on_its_own_check(tmp_path, capsys):
    """The script stops itself on non-finite gradients (before optimizer.step(): watch never checks that
    step); --at N still reports the op that made them, from the ops the step ran before the raise."""
    expected = _first(_plain(SQRT), r"step (\d+) loss \S+ grads nan")
    result = watch(["python", str(SQRT), "--check"], dirpath=tmp_path)
    assert result.error == f"RuntimeError: non-finite gradients at step {expected}" and result.steps == expected
    capsys.readouterr()
    at = watch_at(["python", str(SQRT), "--check"], expected, dirpath=tmp_path)
    data = at.report.to_json()
    assert (data["step"], data["status"], data["origin"]["phase"], data["origin"]["node"]) == \
        (expected, "nonfinite", "backward", "SqrtBackward0")
    assert data["notes"][0].startswith(f"the script raised during step {expected} (RuntimeError: non-finite")
    assert data["fidelity"]["reproduced"] is None and at.exit_code == 1


def test_watch_at_runs_a_compiled_step_eagerly_and_names_modules_without_orig_mod(tmp_path, capsys):
    expected = _first(_plain(SQRT), r"step (\d+) loss \S+ grads nan")
    command = ["python", str(SQRT), "--compile", "aot_eager"]
    result = watch(command, dirpath=tmp_path)
    assert result.events[0].step == expected
    at = watch_at(command, expected, dirpath=tmp_path)
    data = at.report.to_json()
    assert (data["origin"]["phase"], data["origin"]["module"], data["origin"]["node"]) == \
        ("backward", "distance", "SqrtBackward0")
    assert data["fidelity"]["reproduced"] is True and data["findings"][0]["cause"] == "sqrt"
    assert any("set_stance('force_eager')" in n and "it reproduces the watched step" in n for n in data["notes"])


FUNCTIONAL = """
import torch
torch.manual_seed(0)
w = torch.randn(4, 1, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
for step in range(5):
    x = torch.randn(8, 4)
    if step == 0:
        x[0, 0] = float("nan")
    loss = ((x @ w) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_watch_at_says_what_it_cannot_instrument_a_functional_model(tmp_path):
    """No module holds the parameters and the bad step is step 0 (--at arms a functional model at the end of
    the step before, which step 0 has not): watch does not offer --at, and --at says why it instrumented
    nothing."""
    script = tmp_path / "functional.py"
    script.write_text(FUNCTIONAL)
    result = watch(["python", str(script)], dirpath=tmp_path)
    bad = result.events[0]
    assert bad.step == 0 and "--at" not in bad.headline
    assert not any("--at" in n for n in _json(bad.report)["notes"])
    at = watch_at(["python", str(script)], 0, dirpath=tmp_path)
    assert at.report.origin is None and at.report.notes[0].startswith(
        "not instrumented: no module holding the optimizer's parameters was called with gradients enabled in step 0")
    assert at.exit_code == 1   # the watched run's step 0 was bad


def test_watch_at_follows_a_lightning_script_whose_steps_run_in_a_closure(tmp_path, capsys):
    if os.environ.get("NANPROBE_INTEGRATION_TESTS") == "required":   # CI installs the extras: must run there
        import lightning  # noqa: F401
    else:
        pytest.importorskip("lightning")
    script = WATCH / "lightning_sqrt.py"
    expected = _first(_plain(script), r"step (\d+) grads nan")
    result = watch(["python", str(script)], dirpath=tmp_path)
    assert result.events[0].step == expected and result.events[0].report
    at = watch_at(["python", str(script)], expected, dirpath=tmp_path)
    data = at.report.to_json()
    assert (data["step"], data["origin"]["phase"], data["origin"]["node"], data["findings"][0]["cause"]) == \
        (expected, "backward", "SqrtBackward0", "sqrt")
    assert data["origin"]["module"] == "(loss outside the model)" and data["fidelity"]["reproduced"] is True


def test_watch_explains_a_loss_outside_the_model_it_cannot_pin_to_one_op(tmp_path):
    """In-process, a loss outside the model is read from its autograd graph: a div and an acos there leave the
    cause unknown. By default watch re-executes the step, and the --json report names acos, its line and
    cause domain."""
    reports, out = tmp_path / "reports", tmp_path / "watch.json"
    res = runner.invoke(app, ["watch", "--dir", str(reports), "--json", str(out), "--", "python",
                              str(WATCH / "angle_margin.py")])
    assert res.exit_code == 0, res.output
    data = _json(out)
    first = _json(Path(data["watch_explained"]["in_process_report"]))
    assert first["findings"][0]["cause"] == "unknown" and first["origin"]["op"] is None
    assert (data["step"], data["origin"]["op"], data["findings"][0]["cause"]) == (5, "aten.acos.default", "domain")
    assert data["origin"]["source"].endswith("angle_margin.py:30")


def test_watch_does_not_call_a_nan_loss_an_exp_overflow():
    """exp makes +inf, never NaN, from a finite input: a NaN loss whose graph holds only exp (the NaN came in
    through a value computed without gradients, e.g. PPO's advantages) is left to the re-execution."""
    from nanprobe.base.report import Cause
    from nanprobe.reach.forward import loss_outside_finding

    ops = ["MeanBackward0", "MulBackward0", "ExpBackward0", "SubBackward0"]
    finding, origin = loss_outside_finding({"ops": ops, "loss": "nan", "kind": "nan"}, "fp32")
    assert (finding.cause, origin.op) == (Cause.UNKNOWN, None)
    finding, origin = loss_outside_finding({"ops": ops, "loss": "inf", "kind": "inf"}, "fp32")
    assert (finding.cause, origin.op) == (Cause.OVERFLOW, "aten.exp")


def test_explain_says_in_one_line_why_the_re_execution_failed(tmp_path, monkeypatch):
    """A re-execution that stops on an error gives one line with its error and where its output went."""
    import nanprobe.watch.at as at

    monkeypatch.setattr(at, "unlocated_step", lambda events: 3)
    lines, shown = [], []
    at.explain([], ["python", str(tmp_path / "gone.py")], lines.append, steps=8, seconds=1.0, budget=100,
               dirpath=tmp_path, show=shown.append)
    log = tmp_path / "at-step0000003-output.log"
    assert len(lines) == 2 and not shown, lines
    assert lines[1].startswith("nanprobe watch: step 3 was not located in-process; nanprobe watch --at 3 ")
    assert "failed (exit code 2): script " in lines[1] and "gone.py' not found" in lines[1]
    assert lines[1].endswith(f"Its output: {log}") and "not found" in log.read_text()
