"""`nanprobe smoke`: the CI check. Train N steps from scratch under nanprobe.Guard; diagnose the first bad step.

The loop is the canonical one (as in nanprobe.loop.train_step): zero_grad, autocast forward and
loss, guarded backward, clip, guarded optimizer step, scheduler. The guard runs with policy
``raise``: the first non-finite loss/gradient or spike stops training, its capsule is replayed
and diagnosed exactly like ``nanprobe run --capsule``. JUnit XML for CI test reports.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import capsule as _capsule
from .config import Config, load_config
from .diagnose import diagnose_target
from .entry import Loaded, load_target
from .errors import NanprobeError, UsageError, UserCodeError
from .guard import Guard, GuardEvent, GuardTripped
from .loop import make_scaler
from .precision import Precision, autocast_context, describe_device, device_of, numeric_mode, parse_precision
from .replay import batch_source
from .report import Report, Status, StepRecord
from .target import Target, call_user, check_loss, validate

CHECKS = ("entry", "finite", "spike")


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One JUnit test case: a named check and its outcome."""

    name: str                 # "entry" | "finite" | "spike"
    title: str                # what the check asserts, e.g. "20 steps: loss, gradients and weights finite"
    passed: bool | None       # None: not run (an earlier error)
    message: str = ""         # the failure headline
    detail: str = ""          # the diagnosis as text


@dataclass(frozen=True, slots=True, kw_only=True)
class SmokeResult:
    entry: str
    steps: int                # asked for
    steps_run: int            # trained (the bad step included)
    report: Report            # the diagnosis of the first bad step, or a healthy report
    checks: tuple[Check, ...]
    capsule: str | None = None
    command: str | None = None    # `nanprobe run ... --capsule ...` for the bad step
    scaler_skips: int = 0
    seconds: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        return self.report.exit_code

    @property
    def healthy(self) -> bool:
        return self.report.status is Status.FINITE

    @property
    def headline(self) -> str:
        return headline(self.report, self.steps_run)

    def summary(self) -> str:
        """Several lines: the headline, the top finding's evidence and fix, the replay command."""
        return describe(self.report, self.steps_run, capsule=self.capsule, command=self.command,
                        notes=self.notes)

    def to_json(self) -> dict[str, Any]:
        out = self.report.to_json()
        out["command"] = "smoke"
        out["smoke"] = {"steps": self.steps, "steps_run": self.steps_run, "seconds": round(self.seconds, 3),
                        "scaler_skips": self.scaler_skips, "capsule": self.capsule, "replay": self.command,
                        "headline": self.headline,
                        "checks": [{"name": c.name, "title": c.title, "passed": c.passed, "message": c.message}
                                   for c in self.checks],
                        "notes": list(self.notes)}
        return out


def headline(report: Report, steps_run: int | None = None) -> str:
    """One line: what went wrong where and why (or that all steps were healthy)."""
    if report.status is Status.FINITE:
        n = f"{steps_run} steps" if steps_run is not None else "all steps"
        return f"healthy: {n}, no NaN/Inf, no spike"
    what = {Status.NONFINITE: "non-finite values", Status.SPIKE: "loss/gradient spike",
            Status.ERROR: "error"}[report.status]
    text = f"step {report.step}: {what}"
    o = report.origin
    if o is not None:
        text += f" born in {o.phase.value} at {o.module or '(model)'} ({o.node or o.op})"
    top = report.top
    if top is not None:
        text += f"; cause {top.cause.value} ({top.confidence:.2f})"
    return text


def describe(report: Report, steps_run: int | None = None, *, capsule: str | None = None,
             command: str | None = None, notes: tuple[str, ...] = ()) -> str:
    lines = [headline(report, steps_run)]
    o = report.origin
    if o is not None and o.source:
        lines.append(f"  source: {o.source}" + (f"   {o.code}" if o.code else ""))
    top = report.top
    if top is not None:
        lines += [f"  evidence: {e}" for e in top.evidence[:4]]
        if top.fixes:
            fix = top.fixes[0]
            mark = {True: "verified", False: "rerun still fails", None: "not verified"}[fix.verified]
            lines.append(f"  fix ({mark}): {fix.title}")
            lines += ["      " + line for line in fix.code.splitlines()[:6]]
    if capsule:
        lines.append(f"  capsule: {capsule}")
    if command:
        lines.append(f"  replay: {command}")
    lines += [f"  note: {n}" for n in tuple(notes) + report.notes]
    return "\n".join(lines)


# -- loading what to train ----------------------------------------------------------------------------

def _load(obj: Any) -> tuple[Loaded, Callable[[], Loaded] | None, str | None]:
    """ENTRY string / Loaded / Target / dict / zero-arg callable -> (Loaded, rebuild, entry string)."""
    if isinstance(obj, str):
        return load_target(obj), (lambda: load_target(obj)), obj
    if isinstance(obj, Loaded):
        return obj, None, obj.entry
    if isinstance(obj, (Target, dict)):
        where = f"<{type(obj).__name__}>"
        return Loaded(target=validate(obj, where), entry=where, module="", function="", path=None, lineno=None), \
            None, None
    if callable(obj):
        name = getattr(obj, "__qualname__", type(obj).__name__)

        def build() -> Loaded:
            target = validate(call_user(f"{name}()", obj), name)
            return Loaded(target=target, entry=name, module=getattr(obj, "__module__", "") or "",
                          function=name, path=None, lineno=None)
        return build(), build, None
    raise UsageError(f"cannot train a {type(obj).__name__}", "nanprobe.smoke",
                     "Pass ENTRY ('train.py:fn'), a nanprobe.Target, a dict, or a function returning one")


# -- the smoke run -------------------------------------------------------------------------------------------

def smoke(entry: Any, *, steps: int = 20, precision: str | Precision | None = None, config: Config | None = None,
          capsule_dir: str | os.PathLike | None = None,
          on_progress: Callable[[str], None] | None = None) -> SmokeResult:
    """Train ``steps`` steps from scratch under nanprobe.Guard; diagnose the first bad step.

    ``entry`` is an ENTRY string, a nanprobe.Target, a dict, or a function returning one.
    Exit code (``result.exit_code``): 0 healthy, 1 a bad step was found and diagnosed.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"--steps {steps!r} is not a positive number of steps", "--steps", "Give N >= 1")
    cfg = config or load_config()
    progress = on_progress or (lambda msg: None)
    started = time.perf_counter()
    progress("loading the entrypoint")
    loaded, rebuild, entry_str = _load(entry)
    target = loaded.target
    try:
        prec = parse_precision(precision, default=target.precision) if precision is not None else target.precision
    except ValueError:
        raise UsageError(f"unknown precision {precision!r}", "--precision", "Use one of: fp32, bf16, fp16") from None
    model, opt, where = target.model, target.optimizer, loaded.where
    device = device_of(model)
    scaler = make_scaler(target, prec, device.type)
    guard_cfg = dataclasses.replace(cfg.guard, policy="raise", check_every=1,
                                    capsule_dir=str(capsule_dir) if capsule_dir is not None else cfg.guard.capsule_dir)
    guard = Guard(model, opt, scaler=scaler, scheduler=target.scheduler, precision=prec, entry=entry_str,
                  config=guard_cfg)
    get_batch = batch_source(target)
    notes: list[str] = []
    event: GuardEvent | None = None
    steps_run = 0
    log = logging.getLogger("nanprobe.guard")
    was_disabled, log.disabled = log.disabled, True   # the smoke report replaces the guard's log line
    try:
        for k in range(steps):
            try:
                batch = get_batch(k)
            except UserCodeError as exc:
                if not isinstance(exc.exc, StopIteration):
                    raise
                notes.append(f"the batches ran out after {k} steps (asked for {steps})")
                break
            progress(f"step {k + 1}/{steps}")
            steps_run = k + 1
            with guard.step(batch, step=k):
                model.train()
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                with numeric_mode(prec, device.type), autocast_context(prec, device.type):
                    loss = call_user("loss_fn(model, batch)", target.loss_fn, model, batch)
                loss = check_loss(loss, where)
                call_user("loss.backward()", guard.backward, loss)
            try:
                applied = guard.optimizer_step(target.max_grad_norm)
            except GuardTripped as trip:
                event = trip.event
                break
            except NanprobeError:
                raise
            except Exception as exc:  # noqa: BLE001 - the user's optimizer raised
                raise UserCodeError("optimizer.step()", exc) from exc
            if applied and target.scheduler is not None:
                call_user("scheduler.step()", target.scheduler.step)
        if event is None and steps_run and not guard._weights_finite():
            last = steps_run - 1
            event = GuardEvent(step=last, status="nonfinite", action="raised", local=True, capsule=None, command=None,
                               reason=f"the optimizer update of step {last} made the weights non-finite")
    finally:
        log.disabled = was_disabled
    history = [_capsule._record(h) for h in guard._history]
    skips = sum(1 for h in history if h.skipped and h.finite)
    if skips:
        notes.append(f"GradScaler skipped {skips} step(s) while lowering its scale (normal, not failures)")
    if event is None:
        report = Report(command="smoke", entry=loaded.entry, step=None, status=Status.FINITE,
                        device=describe_device(device), precision=prec.value,
                        history=tuple(history[-cfg.replay.history:]), notes=tuple(notes),
                        reached_by=f"trained {steps_run} steps from scratch under nanprobe.Guard")
        return _result(loaded.entry, steps, steps_run, report, None, None, skips, started, ())
    report = _diagnose(event, loaded, rebuild, cfg, prec, history, progress)
    return _result(loaded.entry, steps, steps_run, report, event.capsule, event.command, skips, started,
                   tuple(notes))


def _diagnose(event: GuardEvent, loaded: Loaded, rebuild, cfg: Config, prec: Precision,
              history: list[StepRecord], progress) -> Report:
    if event.capsule is not None:
        progress(f"diagnosing step {event.step} from its capsule")
        reached = _capsule.reach_from_capsule(event.capsule, loaded, cfg, precision=prec)
        reached.reached_by = f"nanprobe.Guard capsule {event.capsule}"
        return diagnose_target(loaded, reached=reached, config=cfg, command="smoke", on_progress=progress)
    # The weights were already non-finite: replay from scratch to the update that made them so.
    if rebuild is not None:
        progress(f"replaying from step 0 to step {event.step}")
        report = diagnose_target(rebuild(), precision=prec, config=cfg, max_steps=event.step + 1, command="smoke",
                                 on_progress=progress)
        if report.status is not Status.FINITE:
            return report
        note = "a replay from step 0 did not reproduce it (nondeterminism?)"
    else:
        note = "pass ENTRY (or a function) instead of built objects to get a replayed diagnosis"
    return Report(command="smoke", entry=loaded.entry, step=event.step, status=Status(event.status),
                  device=describe_device(device_of(loaded.target.model)), precision=prec.value,
                  history=tuple(history), notes=(event.reason, note), reached_by="nanprobe.Guard in smoke")


def _result(entry: str, steps: int, steps_run: int, report: Report, capsule: str | None, command: str | None,
            skips: int, started: float, notes: tuple[str, ...]) -> SmokeResult:
    head = headline(report, steps_run)
    detail = describe(report, steps_run, capsule=capsule, command=command, notes=notes)
    bad = report.status is not Status.FINITE
    finite_failed = bad and report.status is not Status.SPIKE
    spike_failed = report.status is Status.SPIKE
    checks = (
        Check(name="entry", title=f"{entry} builds a valid target", passed=True),
        Check(name="finite", title=f"{steps} steps from scratch: loss, gradients and weights finite",
              passed=not finite_failed, message=head if finite_failed else "", detail=detail if finite_failed else ""),
        Check(name="spike", title="no loss or gradient-norm spike", passed=not spike_failed,
              message=head if spike_failed else "", detail=detail if spike_failed else ""),
    )
    return SmokeResult(entry=entry, steps=steps, steps_run=steps_run, report=report, checks=checks, capsule=capsule,
                       command=command, scaler_skips=skips, seconds=time.perf_counter() - started, notes=notes)


# -- JUnit XML ------------------------------------------------------------------------------------------------

def junit_xml(result: SmokeResult | None, *, entry: str | None = None, error: str | None = None) -> str:
    """One <testsuite> with a <testcase> per check; a failure's message is the diagnosis headline.

    With ``error`` (the run could not start: bad ENTRY, the user's code raised), the entry check
    carries an <error> and the others are skipped.
    """
    name = result.entry if result is not None else (entry or "ENTRY")
    if result is not None:
        checks = result.checks
        seconds = result.seconds
    else:
        checks = (Check(name="entry", title=f"{name} builds a valid target", passed=None, message=error or "error"),
                  Check(name="finite", title="steps finite", passed=None),
                  Check(name="spike", title="no loss or gradient-norm spike", passed=None))
        seconds = 0.0
    failures = sum(1 for c in checks if c.passed is False)
    errors = 1 if result is None else 0
    skipped = sum(1 for c in checks if c.passed is None) - errors
    root = ET.Element("testsuites", name="nanprobe smoke", tests=str(len(checks)), failures=str(failures),
                      errors=str(errors), time=f"{seconds:.3f}")
    suite = ET.SubElement(root, "testsuite", name=f"nanprobe smoke {name}", tests=str(len(checks)),
                          failures=str(failures), errors=str(errors), skipped=str(skipped), time=f"{seconds:.3f}",
                          timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"), hostname=socket.gethostname())
    if result is not None:
        props = ET.SubElement(suite, "properties")
        for key, value in (("entry", result.entry), ("steps", result.steps), ("steps_run", result.steps_run),
                           ("precision", result.report.precision), ("device", result.report.device),
                           ("status", result.report.status.value), ("capsule", result.capsule or "")):
            ET.SubElement(props, "property", name=key, value=str(value))
    for i, c in enumerate(checks):
        case = ET.SubElement(suite, "testcase", classname="nanprobe.smoke", name=f"{c.name}: {c.title}",
                             time=f"{seconds:.3f}" if i == 1 else "0.000")
        if result is None and c.name == "entry":
            el = ET.SubElement(case, "error", message=_xml_safe(c.message), type="error")
            el.text = _xml_safe(c.message)
        elif c.passed is None:
            ET.SubElement(case, "skipped", message="not run: the entrypoint failed")
        elif c.passed is False:
            el = ET.SubElement(case, "failure", message=_xml_safe(c.message), type=result.report.status.value)
            el.text = _xml_safe(c.detail)
    if result is not None:
        out = ET.SubElement(suite, "system-out")
        out.text = _xml_safe(result.summary())
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _xml_safe(text: str) -> str:
    """XML 1.0 forbids most control characters (e.g. ANSI escapes from a user's exception text)."""
    return "".join(ch for ch in text if ch in "\t\n\r" or ord(ch) >= 0x20)


def write_junit(path: str | os.PathLike, result: SmokeResult | None, *, entry: str | None = None,
                error: str | None = None) -> Path:
    p = Path(path)
    if p.suffix in (".py", ".pt", ".pth", ".yaml", ".yml", ".json"):
        raise UsageError(f"refusing to write JUnit XML over {p}", "--junit",
                         "Give an .xml path (nanprobe never overwrites source, checkpoint or config files)")
    try:
        p.write_text(junit_xml(result, entry=entry, error=error))
    except OSError as exc:
        raise UsageError(f"cannot write {p}: {exc.strerror}", "--junit", "Give a writable path") from None
    return p


__all__ = ["smoke", "SmokeResult", "Check", "headline", "describe", "junit_xml", "write_junit"]
