"""`nanprobe watch -- python train.py`: an unmodified script (its own Trainer class, the loss computed in
the model's forward) under the guard through PyTorch's global hooks."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from typer.testing import CliRunner

from conftest import first_nonfinite_update, free_port, leave_worker, tb_scalars
from nanprobe.capsule import read
from nanprobe.surface.cli import app
from nanprobe.pipeline.diagnose import diagnose
from nanprobe.watch import find_loss, parse_command, watch

WATCH = Path(__file__).resolve().parents[1] / "assets" / "watch"
SQRT = WATCH / "sqrt_backward.py"
SCRIPT = WATCH / "own_trainer.py"
LOG_LINE = next(i + 1 for i, text in enumerate(SCRIPT.read_text().splitlines())
                if "nll = rate - counts * torch.log(rate)" in text)
runner = CliRunner()


def _plain(*args: str) -> str:
    """The script run as `python own_trainer.py ARGS` would (in this process, no nanprobe): its stdout."""
    out = io.StringIO()
    argv, path0 = list(sys.argv), sys.path[0]
    sys.argv, sys.path[0] = [str(SCRIPT), *args], str(WATCH)
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv, sys.path[0] = argv, path0
    assert done.value.code == 0
    return out.getvalue()


def _first_nan(stdout: str) -> int:
    return min(int(m.group(1)) for m in re.finditer(r"step (\d+) loss nan", stdout))


def test_watch_skips_and_diagnoses_the_first_nan_of_an_unmodified_script(tmp_path, capsys):
    expected = _first_nan(_plain())   # the script alone: its loss is first NaN at this step (epoch 1)
    capsys.readouterr()
    result = watch(["python", str(SCRIPT), "--exit-code", "3"], dirpath=tmp_path / "reports",
                   json_out=tmp_path / "report.json", entry=f"{WATCH / 'entry.py'}:target")
    out = capsys.readouterr().out
    # the script's own output and exit code
    assert result.exit_code == 3 and result.error is None
    assert out.splitlines()[-1] == "done" and len(re.findall(r"^epoch \d step \d+ loss", out, re.M)) == 24
    assert _first_nan(out) == expected and result.steps == 24 and result.root == "PoissonNet"
    bad = result.events[0]
    assert (bad.step, bad.status, bad.reason, bad.action) == (expected, "nonfinite", "loss is nan", "skipped")

    report = json.loads((tmp_path / "report.json").read_text())
    assert result.json == str(tmp_path / "report.json") and report == json.loads(Path(bad.report).read_text())
    assert report["command"] == "watch" and report["step"] == expected and report["status"] == "nonfinite"
    origin = report["origin"]
    assert (origin["phase"], origin["module"], origin["op"], origin["kind"]) == \
        ("forward", "", "aten.log.default", "nan")
    assert origin["source"].endswith(f"own_trainer.py:{LOG_LINE}")
    top = report["findings"][0]
    assert (top["cause"], top["phase"]) == ("log", "forward")
    assert report["fidelity"]["reproduced"] is True   # the forward rerun gave the loss the script saw
    assert report["watch"]["root"] == "PoissonNet" and report["watch_rerun"] == {"loss_in_forward": True}
    assert report["gradients"]["nonfinite_modules"] == []   # log's gradient 1/x is finite: only the loss is NaN
    assert report["update"]["optimizer"] == "AdamW" and report["update"]["param_groups"][0]["eps"] == 1e-8
    # the capsule replays with the script's own loss: the same origin
    cap = read(bad.capsule)
    assert cap.step == expected and cap.data["max_grad_norm"] == 5.0
    assert bad.command == f"nanprobe run {WATCH / 'entry.py'}:target --capsule {bad.capsule}"
    replayed = diagnose(f"{WATCH / 'entry.py'}:target", capsule=bad.capsule)
    assert (replayed.step, replayed.origin.op, replayed.origin.source, replayed.top.cause.value) == \
        (expected, "aten.log.default", origin["source"], "log")
    assert replayed.fidelity.reproduced is True


@pytest.mark.parametrize("extra", [(), ("--amp",)], ids=["fp32", "fp16+GradScaler"])
def test_watch_healthy_script_writes_nothing_and_keeps_the_weights_bitwise(tmp_path, capsys, extra):
    _plain("--healthy", "--save", str(tmp_path / "plain.pt"), *extra)
    result = watch(["python", str(SCRIPT), "--healthy", "--save", str(tmp_path / "watched.pt"), *extra],
                   dirpath=tmp_path / "reports", json_out=tmp_path / "report.json")
    assert result.exit_code == 0 and result.events == () and result.steps == 24
    plain, watched = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "watched.pt")
    assert plain.keys() == watched.keys() and all(torch.equal(plain[k], watched[k]) for k in plain)
    assert not (tmp_path / "reports").exists() and not (tmp_path / "report.json").exists()


def test_watch_cli_keeps_the_script_output_and_exit_code(tmp_path, monkeypatch):
    monkeypatch.chdir(WATCH)
    res = runner.invoke(app, ["watch", "--dir", str(tmp_path), "--", "python", "-m", "own_trainer", "--exit-code",
                              "4", "--epochs", "2"])
    assert res.exit_code == 4, res.output
    assert res.stdout.splitlines()[-1] == "done"
    lines = res.stderr.splitlines()
    assert lines[0].startswith("nanprobe watch: step 10: non-finite values born in forward at (model) "
                               f"(aten.log.default, own_trainer.py:{LOG_LINE}); cause log (0.90); update skipped. "
                               "Report: ")
    assert all(line.startswith("nanprobe watch: step ") for line in lines[:-1])
    assert re.fullmatch(r"nanprobe watch: 1 process, 16 optimizer step\(s\) seen, \d+ bad step\(s\), 1 report\(s\) "
                        r"written \(first: .*\.json\)", lines[-1])


def test_watch_warns_when_it_saw_no_optimizer_step(tmp_path):
    """A hand-written update (no torch.optim optimizer): watch says it checked nothing, never silence."""
    script = tmp_path / "by_hand.py"
    script.write_text("import torch\nw = torch.ones(3, requires_grad=True)\nfor _ in range(3):\n"
                      "    (w * w).sum().backward()\n    with torch.no_grad():\n        w -= 0.1 * w.grad\n"
                      "    w.grad = None\n")
    res = runner.invoke(app, ["watch", "--dir", str(tmp_path / "r"), "--", "python", str(script)])
    assert res.exit_code == 0
    assert res.stderr.splitlines()[-1].startswith("nanprobe watch: warning: no optimizer step was seen")


def test_watch_policy_raise_stops_the_script_after_the_report(tmp_path, capsys):
    result = watch(["python", str(SCRIPT)], policy="raise", dirpath=tmp_path)
    out = capsys.readouterr().out
    assert result.exit_code == 1 and "done" not in out
    assert [e.action for e in result.events] == ["raised"] and result.events[0].report
    assert result.error.startswith(f"nanprobe stopped training at step {result.events[0].step}: loss is nan "
                                   "(policy 'raise')")


@pytest.mark.parametrize("argv, message", [
    ([], "no command to watch"),
    (["no-such-command-for-nanprobe"], "command 'no-such-command-for-nanprobe' not found"),   # run, not refused
    (["python", "missing.py"], "script 'missing.py' not found"),
    (["python", "-c", "print(1)"], "cannot watch 'python -c print(1)'"),
    (["python", "-m"], "python -m needs a module"),
])
def test_watch_bad_commands_exit_2_with_one_line(argv, message):
    res = runner.invoke(app, ["watch", "--", *argv] if argv else ["watch"])
    assert res.exit_code == 2
    assert res.stderr.startswith(f"nanprobe: error: {message}") and res.stderr.count("\n") == 1
    assert "Traceback" not in res.output


@pytest.mark.parametrize("flags, message", [
    (["--policy", "stop"], "unknown policy 'stop'"),
    (["--json", "-"], "--json - would mix the report with the script's output"),
    (["--max-reports", "-1"], "--max-reports -1"),
])
def test_watch_bad_flags_exit_2_with_one_line(flags, message):
    res = runner.invoke(app, ["watch", *flags, "--", "python", str(SCRIPT)])
    assert res.exit_code == 2 and res.stderr.startswith(f"nanprobe: error: {message}")
    assert res.stderr.count("\n") == 1


def test_watch_judges_a_gradscaler_skip_storm_by_its_scale(tmp_path, capsys):
    """Gradients beyond fp16 even unscaled: the scale halves from 65536 each skip; below 1 (skip 17)
    it is a storm, as Guard, replay and smoke judge it (not only after 64 skips in a row)."""
    result = watch(["python", str(WATCH / "scaler_storm.py")], dirpath=tmp_path)
    bad = result.events[0]
    assert (bad.step, bad.status, bad.action) == (17, "nonfinite", "skipped")
    assert bad.reason.startswith("GradScaler skip storm: step skipped at loss scale 0.5 (< 1)")
    assert bad.headline.startswith("step 17: GradScaler skip storm")
    assert result.events[-1].action == "raised"   # guard.max_consecutive_skips: the storm does not end


def test_watch_error_with_json_writes_an_error_report_named_watch(tmp_path):
    out = tmp_path / "report.json"
    res = runner.invoke(app, ["watch", "--json", str(out), "--", "python", "missing.py"])
    assert res.exit_code == 2
    data = json.loads(out.read_text())
    assert (data["command"], data["status"], data["exit_code"]) == ("watch", "error", 2)


def test_find_loss_reads_the_usual_output_shapes():
    w = torch.ones(2, requires_grad=True)
    loss = (w * 2).sum()
    logits = w * 3
    assert find_loss(loss) is loss
    assert find_loss({"loss": loss, "logits": logits}) is loss
    assert find_loss((logits, loss)) is loss                      # nanoGPT: (logits, loss)
    assert find_loss(type("Out", (), {"loss": loss})()) is loss   # a ModelOutput-like object
    assert find_loss(logits) is None and find_loss((loss, loss)) is None and find_loss(loss.detach()) is None
    assert parse_command(["python3", "-m", "pkg.train", "--lr", "1"]) == ("module", "pkg.train", ["--lr", "1"])


# -- torch.distributed: every rank skips the same step ----------------------------------------------------------

BAD_ON_RANK1 = 2




def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      BAD_STEP=str(BAD_ON_RANK1 if rank == 1 else -1), OUT=str(Path(out_dir) / f"rank{rank}.pt"))
    torch.set_num_threads(1)
    result = watch(["python", str(WATCH / "ddp_trainer.py")], dirpath=out_dir)
    events = [(e.step, e.local, e.rank, e.action, bool(e.report)) for e in result.events]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"code": result.exit_code, "events": events,
                                                             "root": result.root}))
    leave_worker()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_watch_under_ddp_all_ranks_skip_the_step_one_rank_saw(tmp_path):
    mp.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["code"] == r1["code"] == 0 and r0["root"] == r1["root"] == "DistributedDataParallel"
    assert r1["events"] == [[BAD_ON_RANK1, True, 1, "skipped", True]]     # rank 1 saw it, diagnosed it
    assert r0["events"] == [[BAD_ON_RANK1, False, 0, "skipped", False]]   # rank 0 skipped it with rank 1
    w0, w1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) and torch.isfinite(w0[k]).all() for k in w0)   # still in sync, finite


# -- never break a healthy run: copies, saves, closure optimizers ------------------------------------------------

COPIES = WATCH / "copies.py"


def _run_plain(script: Path, *args: str) -> None:
    argv, path0 = list(sys.argv), sys.path[0]
    sys.argv, sys.path[0] = [str(script), *args], str(script.parent)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[0] = argv, path0


@pytest.mark.parametrize("optimizer", [(), ("--lbfgs",)], ids=["adamw", "lbfgs"])
def test_watch_lets_the_script_copy_average_and_save_its_model_with_the_same_weights(tmp_path, optimizer):
    """deepcopy (best model, EMA), AveragedModel, torch.save(model), pickles that load without nanprobe,
    state_dict round trips; LBFGS's closure: bitwise the weights of the script alone."""
    _run_plain(COPIES, "--out", str(tmp_path / "plain.pt"), *optimizer)
    result = watch(["python", str(COPIES), "--out", str(tmp_path / "watched.pt"), *optimizer],
                   dirpath=tmp_path / "reports")
    assert result.exit_code == 0 and result.error is None and result.events == () and result.steps == 6
    plain, watched = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "watched.pt")
    for part in plain:
        assert all(torch.equal(plain[part][k], watched[part][k]) for k in plain[part]), part


def test_watch_checks_a_closure_optimizer_at_the_step_whose_closure_went_bad(tmp_path):
    """LBFGS evaluates its closure several times in one step(): the first evaluation is the step's,
    checked before any update (the step is 3, not 4, and its weights stay finite)."""
    result = watch(["python", str(COPIES), "--out", str(tmp_path / "w.pt"), "--lbfgs", "--bad-step", "3"],
                   dirpath=tmp_path / "reports", json_out=tmp_path / "report.json")
    assert result.exit_code == 0 and result.steps == 6
    assert [(e.step, e.reason, e.action) for e in result.events] == [(3, "loss is nan", "skipped")]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["step"], report["findings"][0]["cause"], report["findings"][0]["phase"]) == (3, "data", "input")
    assert all(torch.isfinite(v).all() for v in torch.load(tmp_path / "w.pt")["model"].values())


# -- update-born: the step whose optimizer update made the weights non-finite ---------------------------------

EPS_ZERO = WATCH / "eps_zero.py"


def _plain_first_nonfinite_update(*args: str) -> int:
    """The oracle: run the script alone and find the first step after whose update a weight is non-finite."""
    return first_nonfinite_update(lambda: _run_plain(EPS_ZERO, *args))


@pytest.mark.parametrize("flag", [(), ("--optimizer-flag", "foreach"), ("--optimizer-flag", "fused")],
                         ids=["for-loop", "foreach", "fused"])
def test_watch_names_the_update_that_made_the_weights_non_finite_at_its_own_step(tmp_path, flag):
    expected = _plain_first_nonfinite_update(*flag)
    result = watch(["python", str(EPS_ZERO), *flag], dirpath=tmp_path, json_out=tmp_path / "report.json")
    bad = result.events[0]
    assert (bad.step, bad.action) == (expected, "raised")   # the weights cannot be recovered by skipping
    assert bad.reason.startswith(f"the AdamW update of step {expected} made the weights non-finite: ")
    assert "of kind.weight (lr=0.01, eps=0); its Adam second moment has" in bad.reason
    report = json.loads((tmp_path / "report.json").read_text())
    origin, top = report["origin"], report["findings"][0]
    assert (report["step"], origin["phase"], origin["module"], origin["parameter"]) == \
        (expected, "update", "kind", "kind.weight")
    assert (top["cause"], top["phase"], top["mechanism"]) == ("div", "update", "adam_second_moment")
    assert "eps=1e-8" in top["fixes"][0]["code"] and bad.command.startswith(f"nanprobe watch --at {expected} ")


def test_watch_reads_the_last_update_at_the_end_of_the_script(tmp_path):
    """The last step's update broke the weights: no later check reads its flag, the script's end does."""
    result = watch(["python", str(EPS_ZERO), "--first-kind", "9", "--steps", "10"], dirpath=tmp_path)
    assert [(e.step, e.status) for e in result.events] == [(9, "nonfinite")]
    assert result.events[0].reason.startswith("the AdamW update of step 9 made the weights non-finite")


def test_watch_explains_a_nan_born_in_a_criterion_module_outside_the_model(tmp_path, capsys):
    """The loss lives in a criterion the loop calls after the model: its forward reruns finite and
    the autograd graph from the loss back to them holds the one op that can make a NaN (log)."""
    script = WATCH / "criterion.py"
    _run_plain(script)
    expected = _first_nan(capsys.readouterr().out)   # the script alone: its loss is first NaN at this step
    result = watch(["python", str(script)], dirpath=tmp_path, json_out=tmp_path / "report.json")
    assert result.events[0].step == expected and result.root == "RateNet"
    report = json.loads((tmp_path / "report.json").read_text())
    origin, top = report["origin"], report["findings"][0]
    assert (report["step"], origin["phase"], origin["module"], origin["op"]) == \
        (expected, "forward", "(loss outside the model)", "aten.log")
    assert (top["cause"], top["phase"]) == ("log", "forward")
    assert top["evidence"][0].startswith("the root module's forward, rerun on the step's inputs under instrumentation, is finite")
    assert report["loss_outside_model"]["ops"][:2] == ["MeanBackward0", "SubBackward0"]
    # the replay command: a capsule of the root module's inputs cannot compute a loss outside it, so every
    # bad step's line (and the report) names the re-execution of the script instead
    assert all(e.command.startswith(f"nanprobe watch --at {e.step} ") and e.command.endswith(f"-- python {script}")
               for e in result.events), [e.command for e in result.events]
    assert report["watch"]["replay"] == result.events[0].command


def test_a_skipped_update_leaves_the_script_its_gradients(tmp_path, capsys):
    """watch skips step 2's update (a NaN in its batch); the script reads p.grad after optimizer.step() as a
    Siamese tutorial does: it finds the gradients it would after a step it skipped itself (NaN there), not
    None (an AttributeError used to end the run)."""
    result = watch(["python", str(WATCH / "grad_after_step.py")], dirpath=tmp_path)
    out = capsys.readouterr().out
    assert result.exit_code == 0 and result.error is None, out
    assert [e.step for e in result.events] == [2]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 5 and "finite False" in lines[2] and all("finite True" in x for i, x in enumerate(lines)
                                                                    if i != 2), lines


def test_finite_weights_whose_squares_overflow_do_not_stop_a_watched_run(tmp_path, capsys):
    """A transformers-style 1e38 sentinel row: the weights flag (an L2 norm) overflows, the weights do not. The
    hook-driven guard (watch, both callbacks) reads them after updates 0 and 10 and lets the run go on."""
    result = watch(["python", str(WATCH / "sentinel_row.py")], dirpath=tmp_path)
    assert result.exit_code == 0 and result.steps == 12 and not result.events, [e.reason for e in result.events]
    assert float(capsys.readouterr().out.split("done ")[1]) == pytest.approx(1e38, rel=1e-6)


def test_watch_reports_a_live_slow_divergence(tmp_path):
    """A loss that breaks away with a precursor behind it (attention logits, fp32: every value finite) is a
    report under watch, by smoke's rule: status diverging, its mechanism and onset; nothing is skipped, the
    summary counts it, and a healthy control (qk-layernorm) is not reported."""
    example = Path(__file__).resolve().parents[2] / "examples" / "attention_logit_growth.py"
    result = watch(["python", str(example), "fp32"], dirpath=tmp_path / "reports")
    assert result.exit_code == 0 and result.steps == 120
    [event] = result.events
    assert (event.status, event.action) == ("diverging", "reported"), event
    assert 60 <= event.step < 120
    data = json.loads(Path(event.report).read_text())
    top = data["findings"][0]
    assert data["status"] == "diverging" and top["mechanism"] == "attention_logit_growth", top
    assert top["onset"] is not None and top["onset"] < event.step and top["module"].endswith(".attn")
    assert "0 bad step(s), 1 slow divergence(s), 1 report(s) written" in result.summary()
    control = Path(__file__).resolve().parents[2] / "examples" / "control_qk_norm.py"
    healthy = watch(["python", str(control)], dirpath=tmp_path / "control")
    assert healthy.exit_code == 0 and healthy.steps > 0 and healthy.events == (), healthy.events


def test_watch_logs_the_precursor_curves_to_the_scripts_own_tensorboard_writer(tmp_path):
    pytest.importorskip("tensorboard", reason="the [tensorboard] extra: pip install -e '.[tensorboard]'")
    logdir = tmp_path / "tb"
    result = watch(["python", str(WATCH / "tensorboard_classifier.py"), str(logdir)], dirpath=tmp_path / "reports")
    assert result.exit_code == 0 and result.steps == 25 and result.events == ()
    tags = tb_scalars(logdir)
    assert tags["loss"] == list(range(25))   # the script's own scalar, as it wrote it
    # every monitored step (monitor.live_every 10; step 0's forward ran before the optimizer was known, so the
    # first step after it is monitored: the level a run that breaks away early is judged against)
    assert tags["nanprobe/2/logsumexp"] == [1, 10, 20] and tags["nanprobe/2/logit_mean"] == [1, 10, 20], tags


def test_watch_checks_a_hand_written_update_and_reports_the_first_bad_step(tmp_path):
    """No torch.optim optimizer (p.data.add_(p.grad, alpha=-lr)): each backward pass is checked as a step; the
    first bad one gets its report and the summary says plainly that nothing could be skipped."""
    result = watch(["python", str(WATCH / "handwritten_sgd.py")], dirpath=tmp_path)
    assert result.handwritten and result.events, result.summary()
    first = result.events[0]
    assert (first.step, first.action, first.reason) == (6, "seen", "loss is nan"), first
    data = json.loads(Path(first.report).read_text())
    top = data["findings"][0]
    assert (data["step"], top["cause"], top["phase"]) == (6, "data", "input"), top
    assert data["watch"]["handwritten"] is True and data["watch"]["action"] == "seen"
    # the step size of each hand-written update is measured (|dw|/|w| between backward passes): small at lr 0.1
    ratios = [h["update_ratio"] for h in data["history"] if h["update_ratio"] is not None]
    assert ratios and all(0 < r < 0.5 for r in ratios), data["history"]
    assert "backward pass(es) checked (no torch.optim optimizer: the update is written by hand, so none could be " \
           "skipped)" in result.summary()
    # the hand-written update made every weight NaN: the next step is stopped, as a skip could not save it either
    assert result.events[-1].action == "raised" and result.exit_code == 1


def test_watch_reports_a_hand_written_loop_that_breaks_away_at_its_first_steps(tmp_path, capsys):
    """A hand-written loop is known as one at its second backward, after step 0's forward: the monitor's first
    sample is then step 1, the level the output head's log Z leaves when the LR jumps at step 4. Without it the
    first sample came at step 10, already diverged, and the break-away had no precursor: nothing was reported."""
    result = watch(["python", str(WATCH / "handwritten_diverge.py")], dirpath=tmp_path)
    losses = [float(x) for x in re.findall(r"step \d+ loss (\S+)", capsys.readouterr().out)]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert max(losses[:4]) < 3 and min(losses[8:]) > 3 * max(losses[:4])   # the plain run's own break-away
    assert result.handwritten and len(result.events) == 1, result.summary()
    data = json.loads(Path(result.events[0].report).read_text())
    top = data["findings"][0]
    assert data["status"] == "diverging" and top["cause"] == "lr_spike", data["findings"]
    # the mechanism leads: no rerun's "largest update" (a hand-written update moves nothing there: |dw|/|w| 0)
    # places the failure in another module
    assert (top["mechanism"], top["module"]) == ("output_logit_divergence", "2"), top
    assert "1 slow divergence(s)" in result.summary() and result.exit_code == 0


def test_watch_says_what_it_could_not_see_and_how_to_cover_it(tmp_path):
    """The summary line and the reports name the parts of a step watch could not see: a clip on gradients the
    GradScaler still scales, a loss outside the model."""
    result = watch(["python", str(WATCH / "unseen_parts.py")], dirpath=tmp_path)
    assert result.exit_code == 0 and result.steps == 12 and result.events == ()
    summary = result.summary()
    assert "not seen: clip_grad_norm_ ran on gradients still scaled by the GradScaler" in summary, summary
    # a loss outside the model (sqrt_backward.py computes it in the loop): said in the summary and the report
    out = watch(["python", str(SQRT)], dirpath=tmp_path / "sqrt")
    assert "not seen: the loss outside the model's forward (watch --at N locates a NaN born there)" in out.summary()
    notes = json.loads(Path(out.events[0].report).read_text())["notes"]
    assert any(n.startswith("not seen by watch: the loss is computed outside the model's forward") for n in notes)


def test_a_clip_inside_the_optimizers_step_is_not_the_next_steps_norm(tmp_path, capsys):
    """BertAdam clips inside step(), after watch's check: that clip's norm must not stand for the next step's
    gradient norm (it did: each step was judged by the previous step's norm)."""
    result = watch(["python", str(WATCH / "clip_inside_step.py")], dirpath=tmp_path)
    printed = {int(s): float(n) for s, n in re.findall(r"step (\d+) grad_norm (\S+)", capsys.readouterr().out)}
    assert result.events and result.events[0].step == 4
    history = json.loads(Path(result.events[0].report).read_text())["history"]
    seen = {h["step"]: h["grad_norm"] for h in history if h["step"] < 4}
    assert seen.keys() == {0, 1, 2, 3}
    for step, norm in seen.items():
        assert norm == pytest.approx(printed[step], rel=1e-5), (step, seen, printed)


def test_a_subclassed_optimizer_calling_super_step_is_one_step(tmp_path):
    """WarmupAdamW.step calls AdamW.step, and a plain AdamW exists too: torch runs the step hooks at both
    levels. That is one step: six steps seen, the NaN batch's step is 3 (not 6 of 12)."""
    result = watch(["python", str(WATCH / "subclassed_optimizer.py")], dirpath=tmp_path / "reports")
    assert result.exit_code == 0 and result.steps == 6, result.summary()
    assert [(e.step, e.reason, e.action) for e in result.events] == [(3, "loss is nan", "skipped")]
