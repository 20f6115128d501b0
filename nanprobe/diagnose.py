"""`nanprobe run` as a library call: load -> reach -> rerun per precision -> classify -> fixes -> Report."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .checks import check_batch
from .classify import Evidence, classify
from .config import Config, load_config
from .entry import Loaded, load_target
from .fixes import attach
from .instrument import Event, Probe
from .precision import Precision, describe_device, device_of, limits, parse_precision
from .replay import NoBadStep, Reached, reach
from .report import Origin, PrecisionResult, Report, Status
from .rerun import StepTrace, resolve_backward_source, run_step
from .target import Target


def autocast_policy(device: torch.device, precision: Precision, policy: str = "native") -> str | None:
    if not precision.autocast:
        return None
    if policy == "cuda" and device.type == "cpu":
        return f"CUDA autocast op list emulated on cpu ({precision.value})"
    return f"native {device.type} autocast ({precision.value})"


def origin_of(e: Event | None, precision: str) -> Origin | None:
    if e is None:
        return None
    return Origin(phase=e.phase, module=e.module, op=e.op, precision=precision, source=e.source, code=e.code,
                  node=e.node, kind=e.kind, samples=e.samples, parameter=e.parameter)


def _probe_for(e: Event | None) -> Probe | None:
    if e is None or e.phase.value == "update":
        return None
    return Probe(phase=e.phase, module=e.module, op=e.op, occurrence=e.occurrence, node=e.node)


def _result(t: StepTrace) -> PrecisionResult:
    if t.error:
        return PrecisionResult(precision=t.precision.value, loss=None, finite=False, note=t.error)
    rec = t.record
    finite = t.finite and not (t.trace and t.trace.events)
    return PrecisionResult(precision=t.precision.value, loss=rec.loss, finite=finite,
                           origin=origin_of(t.origin, t.precision.value), grad_norm=rec.grad_norm)


def diagnose_target(loaded: Loaded, *, at: int | None = None, precision: str | Precision | None = None,
                    config: Config | None = None, max_steps: int | None = None, reached: Reached | None = None,
                    command: str = "run", on_progress: Callable[[str], None] | None = None,
                    policy: str = "native") -> Report:
    """Diagnose one step of an already loaded target (or of a given ``reached`` state, e.g. a capsule)."""
    cfg = config or load_config()
    target: Target = loaded.target
    prec = parse_precision(precision, default=target.precision) if precision is not None else target.precision
    device = device_of(target.model)
    where = loaded.where
    progress = on_progress or (lambda msg: None)
    if reached is None:
        progress("replaying")
        try:
            reached = reach(target, at=at, precision=prec, cfg=cfg.replay, where=where, max_steps=max_steps,
                            on_progress=lambda s: progress(f"replayed step {s}"), policy=policy)
        except NoBadStep as done:
            return Report(command=command, entry=loaded.entry, step=None, status=Status.FINITE,
                          device=describe_device(device), precision=prec.value, history=tuple(done.history[-cfg.replay.history:]),
                          notes=(f"no non-finite value or spike in {done.steps} steps"
                                 + (f" (the --max-steps limit {done.limit})" if done.steps >= done.limit else
                                    " (the data ran out)"),),
                          autocast_policy=autocast_policy(device, prec, policy), reached_by="replay from step 0")
    prec = reached.precision
    progress(f"rerunning step {reached.step} instrumented ({prec.value})")
    main = run_step(target, reached, prec, where=where)
    if resolve_backward_source(target, reached, main, where=where):
        progress("reran once more for the forward line of the backward origin")
    data = check_batch(reached.batch, step=reached.step, ignore_index=target.ignore_index,
                       num_classes=target.num_classes, range_max=limits(prec.dtype).max if prec.low else None,
                       max_examples=cfg.scan.max_examples)
    mark_masked(main)
    reference = probe = None
    ref_prec = parse_precision(cfg.run.reference)
    if ref_prec is Precision.FP64 and device.type == "mps":
        ref_prec = Precision.FP32
    if prec is not ref_prec and prec.low:
        probe = _probe_for(main.origin)
        progress(f"rerunning step {reached.step} in {ref_prec.value} (reference)")
        reference = run_step(target, reached, ref_prec, where=where, probe=probe, tolerate_errors=True)
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
        traces[name] = run_step(target, reached, p, where=where, instrument=False, tolerate_errors=True)
    ev = Evidence(reached=reached, main=main, reference=reference, probe=probe,
                  others={k: v for k, v in traces.items() if k not in (prec.value,)}, data=data, cfg=cfg.run,
                  entry=loaded.entry)
    findings = classify(ev)

    def verify(overrides: dict[str, Any]) -> bool | None:
        if reached.status is Status.SPIKE:
            return None  # a finite spike is not undone by changing this one step
        p = overrides.pop("precision", prec)
        if p.value in traces and not overrides:
            t = traces[p.value]
            return None if t.error else t.finite
        progress(f"verifying a fix ({', '.join(overrides) or p.value})")
        t = run_step(target, reached, p, where=where, instrument=False, tolerate_errors=True, **overrides)
        return None if t.error else t.finite

    findings = attach(findings, ev, verify, verify_enabled=cfg.run.verify_fixes)
    status = reached.status
    if status is Status.FINITE and (main.trace and main.trace.events or not main.finite):
        status = Status.NONFINITE
    if status is Status.FINITE and data and any(p.level == "error" for p in data):
        status = Status.NONFINITE
    context = _context(main, cfg.run.context_modules)
    notes = list(reached.notes) + skipped_notes
    for name, t in traces.items():
        if t.error:
            notes.append(f"{name} rerun could not run: {t.error}")
    return Report(command=command, entry=loaded.entry, step=reached.step, status=status,
                  device=describe_device(device), precision=prec.value, origin=origin_of(main.origin, prec.value),
                  findings=tuple(findings), precisions={k: _result(v) for k, v in traces.items()},
                  context=context, history=tuple(reached.history[-cfg.replay.history:]) + (
                      (reached.record,) if reached.record else ()),
                  notes=tuple(notes), autocast_policy=autocast_policy(device, prec, reached.policy),
                  reached_by=reached.reached_by,
                  extra={"data_problems": [p.to_json() for p in data],
                         "events": [_event_json(e) for e in (main.trace.events if main.trace else [])]})


def mark_masked(t: StepTrace) -> None:
    """Forward events whose values never reached a non-finite loss were masked."""
    if t.trace is None or t.record is None:
        return
    if math.isfinite(t.record.loss):
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
    idx = [i for i, op_index in enumerate(t.trace.range_op_index) if op_index < e.index]
    last = idx[-1] + 1 if idx else 0
    # include the module holding the origin (it finishes after the origin op)
    for i in range(last, len(ranges)):
        if ranges[i].module == e.module:
            last = i + 1
            break
    return tuple(ranges[max(0, last - n):last])


def _event_json(e: Event) -> dict[str, Any]:
    return {"phase": e.phase.value, "module": e.module, "op": e.op, "node": e.node, "kind": e.kind,
            "source": e.source, "masked": e.masked, "samples": list(e.samples)}


def diagnose(entry: str, *, at: int | None = None, precision: str | None = None, config: Config | None = None,
             max_steps: int | None = None, on_progress: Callable[[str], None] | None = None,
             policy: str = "native", capsule: str | None = None, device: str | None = None) -> Report:
    """Load ENTRY, reach step ``at`` (or the first bad step), rerun it instrumented and explain it.

    The state comes from ``capsule`` (a file nanprobe.Guard wrote), else from a capsule for step
    ``at`` in guard.capsule_dir, else from replay (or the target's load_state).
    """
    from dataclasses import replace

    from .capsule import capsule_reach
    loaded = load_target(entry, device=device)
    config = config or load_config()
    reached, notes = capsule_reach(loaded, config, capsule=capsule, at=at, precision=precision, policy=policy)
    report = diagnose_target(loaded, at=at, precision=precision, config=config, max_steps=max_steps,
                             on_progress=on_progress, policy=policy, reached=reached)
    return replace(report, notes=tuple(notes) + report.notes) if notes else report


__all__ = ["diagnose", "diagnose_target", "origin_of"]
