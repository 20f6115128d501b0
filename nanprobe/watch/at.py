"""`nanprobe watch --at N -- python train.py ARGS`: re-execute the unmodified script and explain its step N.

The in-process diagnosis of ``watch`` reruns the root module's forward only: a NaN born in backward (the
gradient of ``sqrt`` at 0) or in the optimizer update is caught at the right step but not located. This
re-executes the script in this process (``runpy``, as ``watch`` does) with step N instrumented
(:mod:`.armed`: ``watch``'s step counting, the instrumentation ``nanprobe run`` uses), then stops it and
classifies the trace with the same ``classify`` and ``fixes`` code into the same JSON report.

Determinism. The watched run's record (:mod:`.record`, found in ``--dir`` by command) gives the script's
start states of Python's ``random`` and numpy (torch's default generator starts from the same seed in every
process, they do not), the updates watch skipped (skipped again) and step N's loss, gradient norm and
whether its update broke the weights: a rerun that differs says "not reproduced" instead of a diagnosis.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..classify import Evidence, classify, scaler_skip_note
from ..classify.mechanism import mechanism_findings
from ..base.config import Config
from ..base.errors import UsageError
from ..reach.feed import Recorded
from ..remedy.fixes import attach
from ..live import resolve_config
from ..locate.instrument import LOSS_FN
from ..base.precision import describe_device
from ..reach.replay import Reached, scheduler_info
from ..base.report import (Cause, Fidelity, Finding, Phase, PrecisionResult, Report, Status, StepRecord, _num, dumps,
                      write_new)
from .armed import OUTSIDE, Done, StepHooks
from .launch import follows
from .record import DEFAULT_DIR, at_command, find_run, restore_start_state
from .run import _script_environment, no_json_dash, parse_command, print_error, run_script

# -- the result ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class AtResult:
    """What ``nanprobe watch --at N`` did: the report of step N, where it went, how the script ended."""

    report: Report
    path: Path | None              # the JSON report written in --dir
    json: str | None = None        # --json OUT
    reproduced: bool | None = None

    @property
    def exit_code(self) -> int:
        return self.report.exit_code

    def summary(self) -> str:
        r = self.report
        where = f"; report: {self.path}" if self.path else ""
        if self.reproduced is False:
            return f"nanprobe watch --at {r.step}: not reproduced{where}"
        o = r.origin
        if o is None:
            return f"nanprobe watch --at {r.step}: {r.status.value}, no origin located{where}"
        top = f", cause {r.top.cause.value}" if r.top is not None else ""
        return (f"nanprobe watch --at {r.step}: origin in {o.phase.value}, module {o.module or '(root)'!s}, "
                f"{o.node or o.op}{' at ' + o.source if o.source else ''}{top}{where}")


def watch_at(command: Sequence[str], at: int, *, dirpath: str | os.PathLike = DEFAULT_DIR,
             json_out: str | os.PathLike | None = None, config: Config | None = None) -> AtResult:
    """Re-execute ``python train.py ARGS`` in this process and explain its optimizer step ``at``
    (see the module docstring). The script's output goes where it would; it is stopped after step ``at``."""
    if isinstance(at, bool) or not isinstance(at, int) or at < 0:
        raise UsageError(f"--at {at!r}", "nanprobe watch", "Give the optimizer step to explain (0, 1, ...), "
                                                           "as watch's log line numbers it")
    if command and follows(command):
        raise UsageError(f"--at with {' '.join(command[:3])!r}: --at re-executes one Python process, not a launcher's ranks",
                         "nanprobe watch --at", "Replay the bad rank's capsule instead: nanprobe run ENTRY --capsule "
                                                "FILE (its log line names it)")
    kind, target, args = parse_command(command)
    cfg = resolve_config(config, "nanprobe watch")
    no_json_dash(json_out)
    script_argv = [target, *args]
    found = find_run(dirpath, at, script_argv, command)
    notes: list[str] = []
    skipped: list[int] = []
    first: dict[str, Any] = {}
    restored: list[str] = []
    if found is None:
        notes.append(f"no record of a watched run of this command in {dirpath}: the rerun is not compared with "
                     "the watched step, and Python random/numpy start as in any fresh process (run nanprobe watch "
                     "first, with the same --dir)")
    else:
        run_path, run, entry_ = found
        first = entry_ or {}
        skipped = [int(s) for s in run.get("skipped", []) if int(s) < at]
        state = run.get("start_state")
        if isinstance(state, dict):
            restored = restore_start_state(state)
        else:
            notes.append(f"the watched run's record {run_path} holds no start state: Python random/numpy start as "
                         "in any fresh process")
        notes.append(f"compared with the watched run's record {run_path}" if entry_ is not None else
                     f"the watched run ({run_path}) saw no bad step {at}: the rerun is not compared with it")
    # a functional model (the watched run called no module holding the optimizer's parameters)
    hooks = StepHooks(at, skipped, functional="root" in first and first["root"] is None)
    script_error = None
    with _script_environment(kind, target, args), hooks:
        try:
            run_script(kind, target)
        except (Done, SystemExit):
            pass
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the script's own error, printed as Python does
            script_error = print_error(exc)
    try:
        if hooks.arm_error is not None:
            raise RuntimeError(f"instrumenting step {at} failed: {type(hooks.arm_error).__name__}: "
                               f"{hooks.arm_error}") from hooks.arm_error
        report, reproduced = _report(hooks, at, command, first, cfg, notes, restored, script_error)
    finally:
        if hooks.snapshot is not None:
            hooks.snapshot.release()
    data = report.to_json()
    data["watch"] = {"at": at, "argv": script_argv, "command": list(command), "restored": restored,
                     "skipped_before": skipped, "steps_reached": hooks.steps}
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    path = write_new(Path(dirpath), f"at-step{at:07d}-{stamp}-{os.getpid()}", data)
    if json_out is not None:
        Path(json_out).write_text(dumps(data) + "\n")
    return AtResult(report=report, path=path, json=None if json_out is None else str(json_out),
                    reproduced=reproduced)


def _matches(expected: Any, got: float | None, rtol: float) -> bool:
    if expected is None or got is None:
        return True   # not measured on one side: nothing to compare
    a, b = float(expected), float(got)   # the record writes non-finite values as "nan", "inf", "-inf"
    return math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-30) or math.isnan(a) and math.isnan(b)


def _report(hooks: StepHooks, at: int, command: Sequence[str], first: dict[str, Any], cfg: Config,
            notes: list[str], restored: list[str], script_error: str | None) -> tuple[Report, bool | None]:
    from ..pipeline.diagnose import _context, _event_json, autocast_policy, check_data, mark_masked, origin_of
    from ..base.precision import device_of
    from ..locate.rerun import StepTrace

    entry = shlex.join(command)
    expected = first.get("record")   # the watched step's numbers (None: no record of it)
    first_status = Status(first["status"]) if first.get("status") in {s.value for s in Status} else None
    reason = first.get("reason")
    saw = [f"the watched run saw {reason} at step {at}"] if reason else []
    what = "; restored at the start: " + ", ".join(restored) if restored else ""
    reached_by = f"nanprobe watch --at {at}: the script re-executed in-process, step {at} instrumented{what}"
    report = functools.partial(Report, command="watch", entry=entry, step=at, reached_by=reached_by)

    def not_reproduced(rows: list[str], device: torch.device | None = None,
                       fidelity: Fidelity | None = None) -> tuple[Report, bool]:
        finding = Finding(cause=Cause.NOT_REPRODUCED, confidence=0.9, phase=Phase.FORWARD, module=None, op=None,
                          evidence=tuple(rows))
        status = first_status if first_status not in (None, Status.FINITE) else Status.NONFINITE
        return report(status=status, device=describe_device(device) if device is not None else "cpu",
                      precision="fp32", findings=(finding,), notes=(rows[0], *notes), fidelity=fidelity), False

    partial = not hooks.done and script_error is not None and hooks.tracker is not None \
        and bool(hooks.tracker.trace.events)
    if partial:   # the script raised inside step N after a non-finite value was born (its own NaN check)
        notes.insert(0, f"the script raised during step {at} ({script_error}): the report is built from the ops "
                        "it ran before that")
    if not hooks.done and not partial:
        why = f"the script raised before step {at} ended ({script_error})" if script_error else \
            f"the script ended after {hooks.steps} optimizer step(s), before step {at} ended"
        return not_reproduced([f"not reproduced: {why}", *saw,
                               "the script takes another path when re-executed (arguments, files it reads or "
                               "writes, the time, unseeded generators other than Python random/numpy/torch, its "
                               "data order)"])
    if hooks.tracker is None:   # a functional model (parameters used without a module call)
        row = (f"not instrumented: no module holding the optimizer's parameters was called with gradients enabled "
               f"in step {at} (a functional model, or parameters used outside modules): --at arms at the model's "
               "first forward, or for a functional model at the end of the step before, which step 0 has not; "
               f"write an ENTRY with your loss_fn and run nanprobe run ENTRY --at {at}")
        return report(status=first_status or Status.FINITE, device="cpu", precision="fp32",
                      notes=(row, *notes)), None
    device = device_of(hooks.root)
    prec = hooks.loop.precision
    finite = (hooks.loss is None or math.isfinite(hooks.loss)) and \
        (hooks.norm is None or math.isfinite(hooks.norm) or hooks.scaler_skipped)
    status = Status.NONFINITE if not finite or hooks.weights_finite is False else Status.FINITE
    rec = StepRecord(step=at, loss=hooks.loss, grad_norm=hooks.norm, lr=hooks.lr, update_ratio=None,
                     finite=status is Status.FINITE, skipped=hooks.scaler_skipped)
    got = {"loss": _num(hooks.loss), "grad_norm": _num(hooks.norm),
           "weights_nonfinite": None if hooks.weights_finite is None else not hooks.weights_finite}
    reproduced: bool | None = None
    reasons: list[str] = []
    rtol = 1e-4
    if expected is not None and not hooks.measured:
        notes.append(f"not compared with the watched run: the script did not reach step {at}'s optimizer step")
    elif expected is not None:
        reasons = [f"{key.replace('_', ' ')} {expected.get(key)} in the watched run, {_num(now)} now"
                   for key, now in (("loss", hooks.loss), ("grad_norm", hooks.norm))
                   if not _matches(expected.get(key), now, rtol)]
        if expected.get("weights_nonfinite") and hooks.weights_finite:
            reasons.append("the watched step's update made the weights non-finite, the rerun's did not")
        reproduced = not reasons
    fidelity = Fidelity(reproduced=reproduced, tolerance=f"rtol {rtol:g}", replayed=dict(expected or {}),
                        reruns=({"rerun": "watch --at (the script's own step, instrumented)", **got,
                                 "match": reproduced},), reasons=tuple(reasons))
    if reproduced is False:
        return not_reproduced([
            f"not reproduced: at step {at} the rerun differs from the watched run: " + "; ".join(reasons), *saw,
            "the script is not deterministic when re-executed: something it reads changed (files, the time, "
            "arguments) or a generator other than Python random/numpy/torch's default is unseeded (a "
            "DataLoader's workers' own seeds, torch.Generator() objects, os.urandom, hash order with "
            "PYTHONHASHSEED unset), or threads/nondeterministic kernels",
            "what to do: seed everything at the script's start, or write an ENTRY with your loss_fn and run "
            f"nanprobe run ENTRY --capsule <the watched run's capsule> (the capsule holds step {at}'s exact "
            "state)"], device, fidelity)
    trace = hooks.tracker.trace
    main = StepTrace(precision=prec, record=rec, trace=trace)
    if first_status is not None and first_status is not Status.FINITE:
        status = first_status if status is Status.FINITE or first_status is Status.NONFINITE else status
    history = [StepRecord(step=h["step"], **{k: _float(h.get(k)) for k in ("loss", "grad_norm", "lr", "update_ratio")},
                          finite=bool(h.get("finite", True)), skipped=bool(h.get("skipped", False)))
               for h in first.get("history", []) if isinstance(h, dict) and isinstance(h.get("step"), int)
               and h["step"] < at]   # the watched run's last steps before N
    reached = Reached(step=at, recorded=Recorded(step=at, items=hooks.items, rng_after=[], position=None),
                      snapshot=hooks.snapshot, loop=hooks.loop, precision=prec, status=status,
                      reason=reason or (f"step {at} is {status.value}" if status is not Status.FINITE else None),
                      record=rec, history=history, reached_by=reached_by, **scheduler_info(hooks.loop.target))
    data = check_data(reached, hooks.loop.target, prec, cfg)
    mark_masked(main)
    ev = Evidence(reached=reached, main=main, reference=None, probe=trace.probe, others={}, data=data, cfg=cfg.run,
                  entry=entry)
    findings, _ = mechanism_findings(classify(ev), trend=None, status=status, step=at, breakaway=None,
                                     ranges=trace.ranges, prec=prec,
                                     origin_module=main.origin.module if main.origin else None)
    findings = attach(findings, ev, None)
    skip_note = scaler_skip_note(ev)   # GradScaler's normal skip: the scale overflowed, not the model
    if skip_note:
        notes.append(skip_note)
    elif status is Status.FINITE and (trace.events or any(p.level == "error" for p in data)):
        status = Status.NONFINITE   # as run: a non-finite value born in the step (masked or not), bad data
    findings = [_outside(f) for f in findings]
    if findings and any(fx.verified is None for f in findings[:1] for fx in f.fixes):
        notes.append(f"fixes not verified: verifying a fix trains forward with it over a horizon, which needs "
                     f"your loss_fn; write an ENTRY (see README, 'The entrypoint') and run nanprobe run ENTRY "
                     f"--at {at} to verify them")
    if hooks.compiled:
        notes.append(f"the script runs torch.compile'd code: step {at} ran eagerly under --at (torch.compiler."
                     "set_stance('force_eager')) so that its ops could be checked" + (
                         "; it reproduces the watched step" if reproduced else
                         "; compiled and eager numerics may differ" if reproduced is None else ""))
    if script_error is None and hooks.scaler_skipped:
        notes.append(f"GradScaler skipped the update of step {at} (non-finite gradients): no update phase ran")
    origin = None if skip_note else _outside(origin_of(main.origin, prec.value))
    return report(status=status, device=describe_device(device), precision=prec.value, origin=origin,
                  findings=tuple(findings),
                  precisions={prec.value: PrecisionResult(precision=prec.value, loss=rec.loss,
                                                          finite=rec.finite and not trace.events,
                                                          origin=origin, grad_norm=rec.grad_norm)},
                  context=_context(main, cfg.run.context_modules), history=tuple(history) + (rec,),
                  notes=tuple(notes), autocast_policy=autocast_policy(device, prec), fidelity=fidelity,
                  extra={"data_problems": [p.to_json() for p in data],
                         "events": [_event_json(e) for e in trace.events]}), reproduced


def _float(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):   # None too
        return None


def _outside(x: Any) -> Any:
    """A finding or origin in the loop's own code: named as the loss outside the model."""
    return dataclasses.replace(x, module=OUTSIDE) if x is not None and x.module == LOSS_FN else x


def unlocated_step(events: Sequence[Any]) -> int | None:
    """The first bad step of a watched run whose report locates no origin (born in backward or update), or
    names no single op for it (a loss outside the model with several ops that could have made the value).
    A finite loss spike whose in-process report names a cause is not one: it has no origin to locate."""
    for e in events:
        if not e.report:
            continue
        try:
            data = json.loads(Path(e.report).read_text())
        except (OSError, ValueError):
            continue
        top = (data.get("findings") or [{}])[0]
        origin = data.get("origin")
        vague = origin is None or (origin.get("op") is None and top.get("cause") == Cause.UNKNOWN.value)
        if data.get("status") == Status.SPIKE.value and top.get("cause") not in (None, Cause.UNKNOWN.value):
            vague = False   # a finite spike has no origin to locate: its in-process cause is the answer
        # a data finding says where the value came from; --at arms at the root module's forward, or for a
        # functional model (none) at the end of the step before (step 0 has none), and counts optimizer steps
        # (a hand-written update has none)
        w = data.get("watch") or {}
        if vague and data.get("status") not in (Status.FINITE.value, Status.DIVERGING.value) \
                and top.get("cause") != Cause.DATA.value and (w.get("root") or e.step > 0) \
                and not w.get("handwritten"):
            return e.step
    return None


def explain(events: Sequence[Any], command: Sequence[str], say: Callable[[str], Any], *, steps: int,
            seconds: float, budget: float, dirpath: str | os.PathLike = DEFAULT_DIR,
            config: str | os.PathLike | None = None, json_out: str | os.PathLike | None = None,
            show: Callable[[str], Any] | None = None, width: int = 120) -> None:
    """After the watched run (``steps`` optimizer steps in ``seconds``), the first bad step it did not locate
    is explained by ``nanprobe watch --at N`` in a fresh interpreter (the script starts as it did: its start
    state is restored from --dir) when reaching it took about ``budget`` seconds or less; else a line says how
    long it would take and gives the command. With ``json_out`` (watch's --json), that file becomes the
    explained report, with a ``watch_explained`` section (how, the in-process report it replaces). The lines
    for the summary go to ``say``; the explained report, rendered ``width`` wide (ANSI), to ``show``. What the
    script prints again while it re-executes goes to a file in --dir, not to the screen a second time."""
    import subprocess
    import tempfile

    step = unlocated_step(events)
    if step is None:
        return
    command_line = at_command(step, command, dirpath)
    reach = seconds * min(1.0, (step + 1) / max(steps, 1))
    if reach > budget:
        say(f"nanprobe watch: step {step} was not located in-process; re-executing the script to it would "
            f"take about {reach:.0f} s, over watch.explain_budget ({budget:.0f} s): {command_line}")
        return
    say(f"nanprobe watch: step {step} was not located in-process: re-executing the script to step {step} "
        "to explain it (--no-explain skips this)")
    log = Path(dirpath) / f"at-step{step:07d}-output.log"
    with tempfile.TemporaryDirectory() as tmp:
        out, rendered = Path(tmp) / "at.json", Path(tmp) / "at.txt"
        argv = [sys.executable, "-m", "nanprobe.surface.cli", "watch", "--at", str(step), "--dir", str(dirpath),
                "--json", str(out), "--report-to", f"{rendered}:{width}",
                *(["--config", str(config)] if config is not None else []), "--", *command]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as f:
            done = subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        try:
            data = json.loads(out.read_text())
        except (OSError, ValueError):
            data = {"status": "error"}
        if data.get("status") == "error":   # it raised, or stopped on an error line (its --json says which)
            tail = data.get("error") or next(iter(log.read_text(errors="replace").strip().splitlines()[-1:]), "")
            say(f"nanprobe watch: step {step} was not located in-process; {command_line} failed "
                f"(exit code {done.returncode})" + (f": {tail.strip()}" if tail else "") + f" Its output: {log}")
            return
        if show is not None and rendered.exists():
            show(rendered.read_text(encoding="utf-8"))
    path = max(Path(dirpath).glob(f"at-step{step:07d}-*.json"), key=lambda p: p.stat().st_mtime, default=None)
    if json_out is not None:
        first = next((e for e in events if e.step == step and e.report), None)
        data["watch_explained"] = {"by": "re-executing the script to the step, instrumented", "command": command_line,
                                   "seconds_to_reach": round(seconds, 1),
                                   "in_process_report": first.report if first is not None else None}
        Path(json_out).write_text(json.dumps(data, indent=2, allow_nan=True))
    o = data.get("origin")
    what = "not reproduced" if (data.get("fidelity") or {}).get("reproduced") is False or o is None and any(
        f.get("cause") == Cause.NOT_REPRODUCED.value for f in data.get("findings", [])) else \
        (f"origin in {o['phase']}, module {o['module'] or '(root)'}, {o.get('node') or o['op']}" if o else
         "no origin located")
    top = (data.get("findings") or [{}])[0].get("cause")
    say(f"nanprobe watch: step {step} was not located in-process, so the script was re-executed with step "
        f"{step} instrumented ({command_line}): {what}" + (f", cause {top}" if top else "")
        + (f"; report: {path}" if path else "") + f"; the script's output this time: {log}")


__all__ = ["watch_at", "explain", "unlocated_step", "AtResult"]
