"""Does a rerun reproduce the replayed step? The promise every diagnosis rests on, checked.

Each rerun of the diagnosed step in the run's own precision, without a fix applied, must give
the loss and gradient norm the replay saw (bitwise on CPU; within ``run.fidelity_rtol_cuda`` on
CUDA, where atomics in backward kernels reorder sums). When it does not, a second plain rerun
tells state the step carries between calls (the two reruns differ from each other) from a
difference fixed at replay time, and the likely reasons are named.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..reach.replay import Reached
from ..base.report import Fidelity, StepRecord
from .rerun import StepTrace


def _same(a: float | None, b: float | None, rtol: float | None) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b if rtol is None else math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-30)


def _values(record: StepRecord | None, trace: StepTrace | None = None) -> dict[str, Any]:
    if record is None:
        raised = trace.exc if trace is not None else None
        return {"raised": f"{type(raised.exc).__name__}" if raised is not None else True}
    return {"loss": record.loss, "grad_norm": record.grad_norm}


def _agree(a: StepRecord, b: StepRecord, rtol: float | None) -> bool:
    return _same(a.loss, b.loss, rtol) and _same(a.grad_norm, b.grad_norm, rtol)


def matches(reached: Reached, trace: StepTrace, rtol: float | None) -> bool:
    """The rerun gave what the replay saw (both raised, or the same loss and gradient norm)."""
    if reached.record is None:   # the replayed step raised: the rerun must raise too
        return trace.record is None and trace.exc is not None
    return trace.record is not None and _agree(reached.record, trace.record, rtol)


def check(reached: Reached, reruns: list[tuple[str, StepTrace]], device: torch.device, rtol_cuda: float,
          again: StepTrace | None = None) -> Fidelity:
    """Compare each comparable rerun with the replayed step; ``again`` is a second plain rerun made
    when the first disagreed (it tells carried state from a one-off difference)."""
    rtol = None if device.type == "cpu" else rtol_cuda
    tol = "bitwise" if rtol is None else f"rtol {rtol:g}"
    if not reruns:
        return Fidelity(reproduced=None, tolerance=tol, replayed=_values(reached.record))
    rows = [dict(rerun=name, **_values(t.record, t), match=matches(reached, t, rtol)) for name, t in reruns]
    ok = all(r["match"] for r in rows)
    reasons = [] if ok else _reasons(reached, reruns, again, device, rtol)
    if not ok and again is not None:
        rows.append(dict(rerun="plain rerun (second)", **_values(again.record, again),
                         match=matches(reached, again, rtol)))
    return Fidelity(reproduced=ok, tolerance=tol, replayed=_values(reached.record), reruns=tuple(rows),
                    reasons=tuple(reasons))


def _reasons(reached: Reached, reruns: list[tuple[str, StepTrace]], again: StepTrace | None,
             device: torch.device, rtol: float | None) -> list[str]:
    out: list[str] = []
    changed = reached.snapshot.changed_in_place()
    if changed:
        out.append(f"the step changes state it keeps between calls in place ({', '.join(changed[:4])}): nanprobe "
                   "restores rebound values, not tensors overwritten in place")
    first = reruns[0][1]
    if reached.compiled:
        out.append("the original step ran torch.compile'd kernels and the reruns run eagerly: fused kernels "
                   "round and order float sums differently, so a value at the edge of a dtype's range can be "
                   "non-finite in one and finite in the other (not state nanprobe missed); to see whether the run "
                   "fails eagerly too, run it with TORCH_COMPILE_DISABLE=1")
    if again is not None and first.record is not None and again.record is not None:
        if not _agree(first.record, again.record, rtol):
            out.append("two reruns from the same state disagree: the step carries state between calls that "
                       "nanprobe does not capture (a global variable, an object outside the model and the step "
                       "function: e.g. a hidden state or a counter kept on another object), or it runs "
                       "nondeterministic ops")
        elif not reached.compiled:
            out.append("the reruns agree with each other but not with the replayed step: something the step reads "
                       "changed when the replay ran it (state kept outside the model and the step function, data "
                       "that changes when re-read)")
    if device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        out.append("CUDA kernels with atomics (index_add, scatter, some convolution backward) are not "
                   "bitwise deterministic: torch.use_deterministic_algorithms(True) rules them out")
    if reached.reached_by.startswith("capsule"):
        out.append("the capsule was written by a run whose code, versions or device may differ from this "
                   "entrypoint's")
    if not out:
        out.append("state nanprobe does not capture (a private torch.Generator, a stateful augmentation)")
    return out


__all__ = ["check", "matches"]
