"""`nanprobe run` as a library call: load -> reach -> rerun per precision -> classify -> fixes -> Report."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from ..locate import fidelity
from ..judge.checks import DataProblem, check_batch
from ..classify import Evidence, classify, explains, scaler_skip_note
from ..classify.mechanism import mechanism_findings
from ..base.config import Config, load_config
from ..reach.entry import Loaded, load_target
from ..base.errors import UsageError, UserCodeError
from ..remedy.fixes import attach
from ..remedy.horizon import verify_over_horizon
from ..locate.instrument import Event, Probe
from ..base.precision import Precision, describe_device, device_of, limits, parse_precision
from ..reach.replay import NoBadStep, Reached, reach
from ..base.report import Cause, Origin, Phase, PrecisionResult, Report, Status
from ..locate.rerun import StepTrace, resolve_backward_source, run_step
from ..judge.shift import batch_shift
from ..reach.state import borrows_globals
from ..reach.target import Target, check_precision


def autocast_policy(device: torch.device, precision: Precision, policy: str = "native",
                    pure: bool = False) -> str | None:
    if pure:
        return f"none: the weights themselves are {precision.value} (no autocast)"
    if not precision.autocast:
        return None
    if policy == "cuda" and device.type == "cpu":
        return f"CUDA autocast op list emulated on cpu ({precision.value})"
    return f"native {device.type} autocast ({precision.value})"


def update_in_question(target: Target, reached: Reached) -> tuple[bool, bool]:
    """(suspect, update) for the reruns of a reached step. Suspect: the replayed step's weights went
    non-finite with a finite loss and gradient norm. Reruns of a loss_fn loop end before the optimizer
    update unless the update is in question (suspect, or the step is a spike): then nothing but the
    forward pass's state needs restoring between reruns."""
    r = reached.record
    suspect = r is not None and not r.finite and all(x is None or math.isfinite(x) for x in (r.loss, r.grad_norm))
    return suspect, target.step_fn is not None or r is None or suspect or reached.status is Status.SPIKE


def origin_of(e: Event | None, precision: str) -> Origin | None:
    if e is None:
        return None
    return Origin(phase=e.phase, module=e.module, op=e.op, precision=precision, source=e.source, code=e.code,
                  node=e.node, kind=e.kind, samples=e.samples, parameter=e.parameter, micro=e.micro)


def _result(t: StepTrace) -> PrecisionResult:
    if t.error or not t.applied:
        return PrecisionResult(precision=t.precision.value, loss=None, finite=False, note=t.error or t.note)
    rec = t.record
    finite = t.finite and not (t.trace and t.trace.events)
    return PrecisionResult(precision=t.precision.value, loss=rec.loss, finite=finite,
                           origin=origin_of(t.origin, t.precision.value), grad_norm=rec.grad_norm)


_FWD_BWD = frozenset({Phase.FORWARD, Phase.BACKWARD})


def _healthy(loaded: Loaded, done: NoBadStep, prec: Precision, device: torch.device, cfg: Config, command: str,
             policy: str) -> Report:
    if done.steps == 0:
        raise UsageError("batches yielded no batch: nothing was trained or checked", loaded.where,
                         "Give the target at least one batch")
    if done.data_ended:
        ran = f" (the data ran out{f' after {done.epochs} epoch(s)' if done.epochs else ''})"
    else:
        ran = f" (the --max-steps limit {done.limit})"
    return Report(command=command, entry=loaded.entry, step=None, status=Status.FINITE,
                  device=describe_device(device), precision=prec.value,
                  history=tuple(done.history[-cfg.replay.history:]),
                  notes=(f"no non-finite value or spike in {done.steps} steps{ran}",) + tuple(done.notes),
                  autocast_policy=autocast_policy(device, prec, policy, loaded.target.pure), reached_by="replay from step 0")


def check_data(reached: Reached, target: Target, prec: Precision, cfg: Config) -> list[DataProblem]:
    """The data checks on every micro-batch of the step (``micro`` set under accumulation).

    When the step raised and the target names no ``num_classes``, the model's output width stands
    in for it (a label out of range makes cross_entropy raise before any NaN exists).
    """
    items = reached.recorded.items
    out: list[DataProblem] = []
    num_classes = target.num_classes
    if num_classes is None and reached.error is not None and items and target.loss_fn is not None:
        from .scan import infer_num_classes
        reached.restore()
        num_classes = infer_num_classes(target, items[0])
        reached.restore()
    for j, item in enumerate(items):
        problems = check_batch(item, step=reached.step, ignore_index=target.ignore_index,
                               num_classes=num_classes,
                               range_max=limits(prec.dtype).max if prec.low else None,
                               max_examples=cfg.scan.max_examples)
        if len(items) > 1:
            problems = [dataclasses.replace(p, micro=j, message=f"micro-batch {j}: {p.message}") for p in problems]
        out += problems
    rec = reached.record
    if reached.error is None and rec is not None and rec.loss is not None and math.isfinite(rec.loss):
        # the step took these labels without raising and gave a finite loss: the loss ignores them
        out = [dataclasses.replace(p, level="warning") if p.code == "label_negative" else p for p in out]
    return out


@borrows_globals
def diagnose_target(loaded: Loaded, *, at: int | None = None, precision: str | Precision | None = None,
                    config: Config | None = None, max_steps: int | None = None, reached: Reached | None = None,
                    command: str = "run", on_progress: Callable[[str], None] | None = None,
                    policy: str = "native") -> Report:
    """Diagnose one step of an already loaded target (or of a given ``reached`` state, e.g. a capsule).

    The target's objects end in the state before the diagnosed step.
    """
    cfg = config or load_config()
    target: Target = loaded.target
    prec = parse_precision(precision, default=target.precision)
    check_precision(target, prec)
    device = device_of(target.model)
    progress = on_progress or (lambda msg: None)
    if reached is None:
        progress("replaying")
        try:
            of = f" of {at}" if at is not None else ""
            reached = reach(target, at=at, precision=prec, cfg=cfg.replay, where=loaded.where, max_steps=max_steps,
                            on_progress=lambda s: progress(f"replayed step {s}{of}"), policy=policy,
                            excursions=at is None, monitor=cfg.monitor)
        except NoBadStep as done:
            return _healthy(loaded, done, prec, device, cfg, command, policy)
    try:
        return _diagnose(loaded, reached, cfg, command, progress)
    finally:
        reached.restore()


def _diagnose(loaded: Loaded, reached: Reached, cfg: Config, command: str,
              progress: Callable[[str], None]) -> Report:
    target = loaded.target
    where = loaded.where
    device = device_of(target.model)
    prec = reached.precision
    raised = reached.error is not None
    progress(f"rerunning step {reached.step} instrumented ({prec.value})")
    # the update phase is checked op by op only where the update may have made the weights non-finite:
    # it is most of a step's ops (an optimizer runs several per parameter)
    suspect, update = update_in_question(target, reached)
    phases = _FWD_BWD | ({Phase.UPDATE} if suspect else set())
    deferred = {"auto": None, "on": True, "off": False}[cfg.run.deferred_checks]
    rerun = functools.partial(run_step, target, reached, where=where, tolerate_errors=True, restore_after=False)
    main = rerun(prec, phases=phases, update=update, deferred=deferred)
    if main.exc is not None and not raised:
        if reached.record is not None:
            raise main.exc   # the rerun raised where the replay did not: report the user's error as it is
        reached.error, raised = main.exc, True   # e.g. a capsule of a step that raised: this is that raise
    comparable: list[tuple[str, StepTrace]] = [(f"instrumented {prec.value}", main)]
    if Phase.UPDATE not in phases and main.record is not None and not main.record.finite \
            and not (main.trace and main.trace.events):
        progress(f"the update of step {reached.step} made the weights non-finite: rerunning it with the update "
                 "instrumented")
        upd = rerun(prec, phases=frozenset({Phase.UPDATE}), ratios=False, deferred=deferred)
        if upd.trace is not None:
            main.trace.events.extend(upd.trace.events)
        comparable.append((f"update-instrumented {prec.value}", upd))
    again = resolve_backward_source(target, reached, main, where=where)
    if again is not None:
        progress("reran once more for the forward line of the backward origin")
        comparable.append((f"anomaly-mode {prec.value}", again))
    data = check_data(reached, target, prec, cfg)
    if reached.before:
        data += batch_shift(reached.recorded.items, [b.items for b in reached.before], step=reached.step,
                            factor=cfg.run.shift_factor, ignore_index=target.ignore_index,
                            max_examples=cfg.scan.max_examples)
    mark_masked(main)
    fid = fidelity.check(reached, comparable, device, cfg.run.fidelity_rtol_cuda)
    if fid.reproduced is False:
        progress(f"rerun of step {reached.step} differs from the replay: rerunning it once more")
        second = rerun(prec, instrument=False, ratios=False, update=update)
        fid = fidelity.check(reached, comparable, device, cfg.run.fidelity_rtol_cuda, again=second)
    evidence_found = bool(main.trace and main.trace.events) or any(p.level == "error" for p in data) \
        or explains(reached.error)
    if raised and not evidence_found:
        err = reached.error
        pos = reached.position.describe() if reached.position else f"step {reached.step}"
        raise UserCodeError(f"{err.during} at {pos}", err.exc,
                            fix="No NaN/Inf and no data problem came before it: fix the error in your code, "
                                "or rerun with --debug for the full traceback")
    reference = probe = None
    ref_prec = parse_precision(cfg.run.reference)
    if ref_prec is Precision.FP64 and device.type == "mps":
        ref_prec = Precision.FP32
    if prec is not ref_prec and prec.low:
        e = main.origin
        if e is not None and e.phase is not Phase.UPDATE:
            probe = Probe(phase=e.phase, module=e.module, op=e.op, occurrence=e.occurrence, node=e.node)
        progress(f"rerunning step {reached.step} in {ref_prec.value} (reference)")
        reference = rerun(ref_prec, probe=probe, phases=_FWD_BWD, ratios=False, update=update,
                          instrument=main.origin is not None, deferred=deferred)
        if main.origin is None and not reference.finite and not reference.error:
            reference = rerun(ref_prec, phases=_FWD_BWD, ratios=False, update=update, deferred=deferred)
    traces: dict[str, StepTrace] = {prec.value: main}
    skipped_notes: list[str] = []
    if reference is not None:
        traces[ref_prec.value] = reference
    for name in cfg.run.precisions:
        p = parse_precision(name)
        if name in traces or p is Precision.TF32 and device.type != "cuda" or p is Precision.FP64:
            continue
        if p is Precision.FP16 and device.type == "cpu" and not cfg.run.fp16_on_cpu:
            skipped_notes.append("fp16 rerun skipped on CPU (slow fp16 kernels; run.fp16_on_cpu: true, "
                                 "nanprobe compare-precisions or --device cuda show it)")
            continue
        progress(f"rerunning step {reached.step} in {name}")
        traces[name] = rerun(p, instrument=False, ratios=False, update=update)
    ev = Evidence(reached=reached, main=main, reference=reference, probe=probe,
                  others={k: v for k, v in traces.items() if k not in (prec.value,)}, data=data, cfg=cfg.run,
                  entry=loaded.entry)
    findings = classify(ev)
    findings, onset = mechanism_findings(findings, trend=reached.trend, status=reached.status, step=reached.step,
                                         breakaway=reached.breakaway, ranges=main.trace.ranges if main.trace else (),
                                         prec=prec, origin_module=main.origin.module if main.origin else None)
    if reached.onset is not None and reached.onset != reached.step:
        began = [n for n in reached.notes if n.startswith(f"step {reached.onset} ")]
        later = [n for n in reached.notes if "did not recover" in n and not n.startswith(f"step {reached.onset} ")]
        findings = [dataclasses.replace(f, onset=reached.onset, evidence=f.evidence + tuple(
            f"onset: {n}" for n in began[:1]) + tuple(later[:1])) for f in findings]
    findings = attach(findings, ev, (lambda top, candidates: verify_over_horizon(   # from the top finding's onset
        loaded, reached, top.onset, candidates, cfg, progress)) if cfg.run.verify_fixes else None)
    if fid.reproduced is False:
        findings = [f if f.cause is Cause.NOT_REPRODUCED else dataclasses.replace(
            f, confidence=round(f.confidence * 0.6, 3),
            evidence=f.evidence + ("confidence lowered: the rerun does not reproduce the replayed step "
                                   "(see fidelity)",)) for f in findings]
        findings.sort(key=lambda f: -f.confidence)
    status = reached.status
    skip_note = scaler_skip_note(ev)   # GradScaler's normal skip: the scale overflowed, not the model
    if status is Status.FINITE and (not skip_note and (main.trace and main.trace.events or not main.finite)
                                    or any(p.level == "error" for p in data)):
        status = Status.NONFINITE
    notes = list(reached.notes) + skipped_notes + ([skip_note] if skip_note else [])
    error_line = reached.error.message if raised else None
    if raised:
        notes.insert(0, f"the step raised: {error_line}")
    if fid.reproduced is False:
        notes.insert(0, "the rerun of this step does not reproduce the replayed one: " + "; ".join(fid.reasons[:2]))
    for name, t in traces.items():
        if t.error and not (raised and name == prec.value):
            notes.append(f"{name} rerun could not run: {t.error}")
        if t.note:
            notes.append(f"{name} rerun: {t.note}")
    history = tuple(reached.history[-cfg.replay.history:]) + ((reached.record,) if reached.record else ())
    pos = reached.position
    position = None if pos is None else {"epoch": pos.epoch, "index": pos.index, "items": list(pos.items),
                                         "micro_batches": len(reached.recorded.items)}
    return Report(command=command, entry=loaded.entry, step=reached.step, status=status,
                  device=describe_device(device), precision=prec.value,
                  origin=None if skip_note else origin_of(main.origin or _entered_origin(main, findings), prec.value),
                  findings=tuple(findings), precisions={k: _result(v) for k, v in traces.items()},
                  context=_context(main, cfg.run.context_modules), history=history,
                  notes=tuple(notes), autocast_policy=autocast_policy(device, prec, reached.policy,
                                                                  target.pure and prec is target.weights),
                  reached_by=reached.reached_by, position=position, fidelity=fid, error=error_line,
                  trajectory=reached.trend.to_json(onset) if reached.trend is not None and onset is not None else None,
                  extra={"data_problems": [p.to_json() for p in data],
                         "events": [_event_json(e) for e in (main.trace.events if main.trace else [])]})


def _entered_origin(t: StepTrace, findings: list) -> Event | None:
    """Where a non-finite value no op produced entered the step, when a finding is built on it (the origin
    the report shows for a NaN constant in the user's code)."""
    e = t.trace.entered if t.trace is not None else None
    return e if e is not None and any(f.cause is Cause.UNKNOWN and f.op == e.op for f in findings) else None


def mark_masked(t: StepTrace) -> None:
    """Forward events whose values never reached a non-finite loss were masked."""
    if t.trace is not None and t.record is not None and t.record.loss is not None \
            and math.isfinite(t.record.loss):   # None: the step_fn returned no loss
        for e in t.trace.events:
            if e.phase.value == "forward":
                e.masked = True


def _context(t: StepTrace, n: int):
    if t.trace is None or not t.trace.ranges:
        return ()
    ranges = t.trace.ranges
    e = t.origin
    if e is None or e.phase.value != "forward":
        return tuple(ranges[-n:])
    last = max((i + 1 for i, op_index in enumerate(t.trace.range_op_index) if op_index < e.index), default=0)
    # include the module holding the origin (it finishes after the origin op)
    last = next((i + 1 for i in range(last, len(ranges)) if ranges[i].module == e.module), last)
    return tuple(ranges[max(0, last - n):last])


def _event_json(e: Event) -> dict[str, Any]:
    out = {"phase": e.phase.value, "module": e.module, "op": e.op, "node": e.node, "kind": e.kind,
           "source": e.source, "masked": e.masked, "samples": list(e.samples)}
    if e.micro is not None:
        out["micro"] = e.micro
    return out


@borrows_globals
def diagnose(entry: str, *, at: int | None = None, precision: str | None = None, config: Config | None = None,
             max_steps: int | None = None, on_progress: Callable[[str], None] | None = None,
             policy: str = "native", capsule: str | None = None, device: str | None = None) -> Report:
    """Load ENTRY, reach step ``at`` (or the first bad step), rerun it instrumented and explain it.

    The state comes from ``capsule`` (a file nanprobe.Guard wrote), else from a capsule for step
    ``at`` in guard.capsule_dir, else from replay (or the target's load_state).
    """
    from ..capsule import capsule_reach
    loaded = load_target(entry, device=device)
    config = config or load_config()
    extra: dict = {}   # a sharded capsule (directory): the rank replayed
    reached, notes = capsule_reach(loaded, config, capsule=capsule, at=at, precision=precision, policy=policy,
                                   extra=extra)
    report = diagnose_target(loaded, at=at, precision=precision, config=config, max_steps=max_steps,
                             on_progress=on_progress, policy=policy, reached=reached)
    return dataclasses.replace(report, extra={**report.extra, **extra}, notes=tuple(notes) + report.notes)


__all__ = ["diagnose", "diagnose_target", "origin_of"]
