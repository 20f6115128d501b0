"""`nanprobe smoke`: the CI check. Train N steps from scratch; diagnose the first bad step.

The steps are the target's own loop (nanprobe.reach.step: the canonical loss_fn loop with epochs and
accumulation, or the user's step_fn), judged with the guard's thresholds. The first non-finite
loss, gradient or weight, or spike, stops training; its capsule is written (a CI artifact that
``nanprobe run --capsule`` replays) and the step is diagnosed exactly like ``nanprobe run``.
JUnit XML for CI test reports.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import capsule as _capsule
from ..base.config import Config, ReplayConfig, load_config
from .diagnose import diagnose_target
from ..reach.entry import Loaded, load_target
from ..base.errors import UsageError
from ..base.precision import Precision, describe_device, device_of, parse_precision
from ..reach.replay import NoBadStep, reach
from ..base.report import Report, Status
from ..reach.state import borrows_globals
from ..reach.target import Target, call_user, check_precision, validate

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

    @property
    def checks(self) -> tuple[Check, ...]:
        def check(name: str, title: str, failed: bool) -> Check:
            if not failed:
                return Check(name=name, title=title, passed=True)
            return Check(name=name, title=title, passed=False, message=self.headline, detail=self.summary())

        spike = self.report.status is Status.SPIKE
        return (check("entry", f"{self.entry} builds a valid target", False),
                check("finite", f"{self.steps} steps from scratch: loss, gradients and weights finite",
                      not self.healthy and not spike),
                check("spike", "no loss or gradient-norm spike", spike))

    def summary(self) -> str:
        """Several lines: the headline, the top finding's evidence and fix, the capsule and replay command."""
        report = self.report
        lines = [self.headline]
        o = report.origin
        if o is not None and o.source:
            lines.append(f"  source: {o.source}" + (f"   {o.code}" if o.code else ""))
        top = report.top
        if top is not None:
            lines += [f"  evidence: {e}" for e in top.evidence[:4]]
            if top.fixes:
                fix = top.fixes[0]
                mark = {True: "verified", False: "failed over the horizon", None: "not verified"}[fix.verified]
                lines.append(f"  fix ({mark}): {fix.title}" + (f" - {fix.verify_note}" if fix.verify_note else ""))
                lines += ["      " + line for line in fix.code.splitlines()[:6]]
        if self.capsule:
            lines.append(f"  capsule: {self.capsule}")
        if self.command:
            lines.append(f"  replay: {self.command}")
        lines += [f"  note: {n}" for n in self.notes + report.notes]
        return "\n".join(lines)

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
            Status.DIVERGING: "slow divergence", Status.ERROR: "error"}[report.status]
    text = f"step {report.step}: {what}"
    o = report.origin
    if o is not None:
        where = f", {os.path.basename(o.source)}" if o.source else ""   # file:line, the file's name only
        what = o.node or o.op or (f"parameter {o.parameter}" if o.parameter else None)
        text += f" born in {o.phase.value} at {o.module or '(model)'} ({what}{where})"
    top = report.top
    if top is not None:
        text += f"; cause {top.cause.value} ({top.confidence:.2f})"
    return text


# -- loading what to train ----------------------------------------------------------------------------

def _scaler_skips(history) -> tuple[int, tuple[str, ...]]:
    """GradScaler's normal skips among the steps run, and the note that says so."""
    skips = sum(1 for h in history if h.skipped and h.finite)
    return skips, (f"GradScaler skipped {skips} step(s) while lowering its scale (normal, not failures)",) \
        if skips else ()


def _load(obj: Any) -> tuple[Loaded, str | None]:
    """ENTRY string / Loaded / Target / dict / zero-arg callable -> (Loaded, entry string)."""
    if isinstance(obj, str):
        return load_target(obj), obj
    if isinstance(obj, Loaded):
        return obj, obj.entry
    if isinstance(obj, (Target, dict)):
        where = f"<{type(obj).__name__}>"
        return Loaded(target=validate(obj, where), entry=where, module="", function="", path=None, lineno=None), None
    if callable(obj):
        name = getattr(obj, "__qualname__", type(obj).__name__)
        target = validate(call_user(f"{name}()", obj), name)
        return Loaded(target=target, entry=name, module=getattr(obj, "__module__", "") or "", function=name,
                      path=None, lineno=None), None
    raise UsageError(f"cannot train a {type(obj).__name__}", "nanprobe.smoke",
                     "Pass ENTRY ('train.py:fn'), a nanprobe.Target, a dict, or a function returning one")


# -- the smoke run -------------------------------------------------------------------------------------------

def _smoke_replay_config(cfg: Config) -> ReplayConfig:
    """Smoke judges steps with the guard's thresholds (it stands for the guarded training run). The guard never
    measures |dw|/|w| (it copies no weights): neither does smoke's judge."""
    g, shared = cfg.guard, {f.name for f in dataclasses.fields(cfg.replay)}
    return dataclasses.replace(cfg.replay, spike_window=g.window, update_ratio_limit=float("inf"), **{
        f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.name in shared})


@borrows_globals
def smoke(entry: Any, *, steps: int = 20, precision: str | Precision | None = None, config: Config | None = None,
          capsule_dir: str | os.PathLike | None = None,
          on_progress: Callable[[str], None] | None = None) -> SmokeResult:
    """Train ``steps`` steps from scratch in the target's own loop (epochs, accumulation, step_fn), with
    the guard's checks; diagnose the first bad step and save its capsule.

    ``entry`` is an ENTRY string, a nanprobe.Target, a dict, or a function returning one.
    Exit code (``result.exit_code``): 0 healthy, 1 a bad step was found and diagnosed; data that ends
    before ``steps`` steps is a usage error (exit 2): a CI check must not pass on fewer steps.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"--steps {steps!r} is not a positive number of steps", "--steps", "Give N >= 1")
    cfg = config or load_config()
    progress = on_progress or (lambda msg: None)
    started = time.perf_counter()
    progress("loading the entrypoint")
    loaded, entry_str = _load(entry)
    target = loaded.target
    try:
        prec = parse_precision(precision, default=target.precision)
    except ValueError:
        raise UsageError(f"unknown precision {precision!r}", "--precision", "Use one of: fp32, bf16, fp16") from None
    check_precision(target, prec)
    device = device_of(target.model)
    rcfg = _smoke_replay_config(cfg)
    folder = str(capsule_dir) if capsule_dir is not None else cfg.guard.capsule_dir
    try:
        reached = reach(target, at=None, precision=prec, cfg=rcfg, where=loaded.where, max_steps=steps,
                        on_progress=lambda k: progress(f"step {k + 1}/{steps}"), monitor=cfg.monitor)
    except NoBadStep as done:
        if done.data_ended:
            epochs = f" ({done.epochs} epoch(s))" if done.epochs else ""
            raise UsageError(f"the data ended after {done.steps} steps{epochs}, before --steps {steps}", loaded.where,
                             "Lower --steps, raise the target's 'epochs', or give more batches") from None
        history = list(done.history)
        skips, notes = _scaler_skips(history)
        notes = notes + tuple(f"warning: {n}" for n in done.notes)
        report = Report(command="smoke", entry=loaded.entry, step=None, status=Status.FINITE,
                        device=describe_device(device), precision=prec.value,
                        history=tuple(history[-cfg.replay.history:]), notes=notes,
                        reached_by=f"trained {done.steps} steps from scratch with the guard's checks")
        return SmokeResult(entry=loaded.entry, steps=steps, steps_run=done.steps, report=report, scaler_skips=skips,
                           seconds=time.perf_counter() - started)
    skips, skip_notes = _scaler_skips(reached.history)
    notes = list(skip_notes)
    path = command = None
    try:
        path = _capsule.write(_capsule.build_from_reached(reached, entry=entry_str), folder)
        command = _capsule.replay_command(entry_str, path)
    except OSError as exc:
        notes.append(f"capsule not written: {exc.strerror or exc}")
    reached.reached_by = f"trained from scratch with the guard's checks; step {reached.step} failed"
    progress(f"diagnosing step {reached.step}")
    report = diagnose_target(loaded, reached=reached, config=cfg, command="smoke", on_progress=progress)
    return SmokeResult(entry=loaded.entry, steps=steps, steps_run=reached.step + 1, report=report,
                       capsule=None if path is None else str(path), command=command, scaler_skips=skips,
                       seconds=time.perf_counter() - started, notes=tuple(notes))


# -- JUnit XML ------------------------------------------------------------------------------------------------

def junit_xml(result: SmokeResult | None, *, entry: str | None = None, error: str | None = None) -> str:
    """One <testsuite> with a <testcase> per check; a failure's message is the diagnosis headline.

    With ``error`` (the run could not start: bad ENTRY, the user's code raised), the entry check
    carries an <error> and the others are skipped.
    """
    name = result.entry if result is not None else (entry or "ENTRY")
    checks, seconds = (result.checks, result.seconds) if result is not None else (
        (Check(name="entry", title=f"{name} builds a valid target", passed=None, message=error or "error"),
         Check(name="finite", title="steps finite", passed=None),
         Check(name="spike", title="no loss or gradient-norm spike", passed=None)), 0.0)
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


__all__ = ["smoke", "SmokeResult", "Check", "headline", "junit_xml", "write_junit"]
