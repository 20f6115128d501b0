"""Rerun one step from a snapshot, in one precision, optionally instrumented -> StepTrace."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from ..base.batch import map_tensors
from ..base.errors import UserCodeError
from .instrument import Event, OriginTracker, Probe, Trace
from ..base.precision import Precision, emulate_fp16_matmuls, retarget_casts
from ..reach.replay import Reached, measure
from ..base.report import Phase, StepRecord
from ..reach.state import Snapshot
from ..reach.step import _KEEP, Loop, RunOptions, StepOutcome, batch_size


@dataclass(slots=True)
class StepTrace:
    precision: Precision
    record: StepRecord | None
    trace: Trace | None
    update_ratios: dict[str, float] = field(default_factory=dict)
    error: str | None = None          # the rerun itself failed (e.g. dtype not supported here)
    exc: UserCodeError | None = None  # ... with the user's exception
    note: str | None = None           # e.g. the precision could not be applied to a step_fn
    applied: bool = True              # the asked precision was applied
    outcome: StepOutcome | None = None  # the step's own tensors (e.g. the loss at full precision)

    @property
    def finite(self) -> bool:
        return self.record is not None and self.record.finite

    @property
    def origin(self) -> Event | None:
        return self.trace.events[0] if self.trace and self.trace.events else None


@contextlib.contextmanager
def _cast_weights(loop: Loop, snapshot: Snapshot, update: bool, dtype: torch.dtype):
    """Run the step with the weights in ``dtype``: parameters, buffers and gradients cast in place (same
    objects); for float64 the default dtype too. The optimizer state follows them only when the step runs
    its update. On exit, errors too, every tensor gets its original storage back (untouched by the step:
    the cast made new ones), the optimizer state its dtypes, so the state is exactly the one before."""
    from ..reach.state import _versions

    model = loop.target.model
    # each tensor's own data (its storage) is kept and put back: views the user holds keep tracking it
    saved = [(t, t.data) for t in [*model.parameters(), *model.buffers()]
             if t.is_floating_point() and t.dtype != dtype]
    default = torch.get_default_dtype()

    snapshot.restore(loop.objects, partial_ok=True)   # the exact values, before casting them
    try:
        with torch.no_grad():
            for t, data in saved:
                t.grad = None if t.is_leaf else t.grad
                t.data = data.to(dtype)
        if dtype is torch.float64:
            torch.set_default_dtype(torch.float64)
        if update:   # the optimizer state follows the parameters' dtype (torch's own rule)
            snapshot.restore(loop.objects)
        yield
    finally:
        torch.set_default_dtype(default)
        with torch.no_grad():
            for t, data in saved:
                if t.is_leaf:
                    t.grad = None
                t.data = data          # the original storage, untouched by the cast step
        if update:
            snapshot.restore(loop.objects)   # the optimizer state back to its dtypes
        else:
            snapshot.clean = _versions(loop.objects)


def _scaler_for(loop: Loop, precision: Precision, grad_scaler: bool | None,
                scale: float | None) -> Any:
    """The GradScaler a ``loss_fn`` rerun uses (RunOptions.scaler): the loop's own in its precision,
    none outside fp16, a fresh one where a rerun asks for one the run did not have."""
    target = loop.target
    use = target.uses_scaler if grad_scaler is None else grad_scaler
    if target.step_fn is not None:
        return _KEEP   # the user's step drives its own GradScaler
    if precision is not Precision.FP16 or not use or not target.optimizers:
        return None
    if loop.scaler is not None and scale is None:
        return _KEEP
    return torch.amp.GradScaler(loop.device_type, init_scale=65536.0 if scale is None else scale)


def run_step(target, reached: Reached, precision: Precision, *, where: str, instrument: bool = True,
             probe: Probe | None = None, max_grad_norm: float | None = None,
             lr_scale: float | None = None, param_overrides: dict[str, Any] | None = None,
             grad_scaler: bool | None = None, scale: float | None = None, tolerate_errors: bool = False,
             observe: Callable[[Phase], None] | None = None, source_of_node: int | None = None,
             restore_after: bool = True, phases: frozenset[Phase] | None = None,
             ratios: bool = True, update: bool = True, emulate_fp16: bool = False,
             deferred: bool | None = None) -> StepTrace:
    """Restore the state before the step and run it once; with ``restore_after`` (the default) restore
    again, so the user's objects end unchanged. A caller that reruns several times passes False and
    restores once at the end (``Reached.restore``): each restore copies the whole state.

    ``observe(phase)`` is called at each phase boundary (after the tracker), e.g. to read the
    gradients when the update phase begins. ``scale`` starts a GradScaler at that loss scale.
    ``phases``: the phases whose ops the tracker checks one by one (default all); ``ratios``:
    measure the update ratios |dw|/|w| (one more read of the saved parameters). ``update=False``
    (``loss_fn`` loops whose replayed update was finite) ends the step after its gradients: the
    weights stay as they are, so the next restore only writes back what a forward pass changes;
    the record then carries the replayed step's own update ratio. ``emulate_fp16``: CPU fp16 matmuls
    as fp16-rounded inputs times float32 arithmetic (see precision.emulate_fp16_matmuls).
    ``deferred`` (default: on CUDA): the tracker reads each op's finiteness back once per phase, not
    per op; when an op went non-finite, a second pass checks those ops one by one.
    """
    loop = reached.loop
    snapshot = reached.snapshot
    skip_update = not update and loop.target.step_fn is None and reached.record is not None
    sizes = [batch_size(item) for item in reached.recorded.items]
    # the dtype the weights are cast to: float64 for fp64; for weights stored in bf16/fp16, any other
    # precision's (the weights' dtype is what the run computes in, autocast or not)
    weights = loop.target.weights
    cast = torch.float64 if precision is Precision.FP64 else \
        precision.dtype if weights is not None and precision is not weights else None

    def once(mode: dict | None) -> StepTrace:
        snapshot.restore(loop.objects, partial_ok=True)
        tracker = OriginTracker(loop.target.model, [o for _, o in loop.target.optimizers],
                                low_dtype=precision.dtype if precision.low else reached.precision.dtype
                                if reached.precision.low else torch.float16,
                                batch_size=sizes[0] if sizes else None, probe=probe,
                                source_of_node=source_of_node, phases=phases, **(mode or {})) if instrument else None

        def on_phase(phase: Phase) -> None:
            tracker.set_phase(phase)
            if observe is not None:
                observe(phase)

        def on_micro(j: int) -> None:
            tracker.set_micro(j, sizes[j] if j < len(sizes) else None, len(sizes))

        options = RunOptions(precision=precision, policy=reached.policy,
                             on_phase=on_phase if tracker is not None else observe,
                             on_micro=on_micro if tracker is not None else None, max_grad_norm=max_grad_norm,
                             lr_scale=lr_scale, param_overrides=param_overrides,
                             scaler=_scaler_for(loop, precision, grad_scaler, scale),
                             stop_before_update=skip_update)
        feed = reached.recorded.feed()
        try:
            with contextlib.ExitStack() as stack:
                if emulate_fp16 and precision is Precision.FP16 and loop.device_type == "cpu":
                    stack.enter_context(emulate_fp16_matmuls())   # outermost: the tracker above sees the user's ops
                if cast is not None:  # the user's objects get their dtypes back when the stack exits
                    if loop.target.weights is not None:   # the user's own casts to the weights' dtype follow them
                        stack.enter_context(retarget_casts(loop.target.weights.dtype, cast))
                    stack.enter_context(_cast_weights(loop, snapshot, update=not skip_update, dtype=cast))
                    feed = _CastFeed(feed, cast, None if cast is torch.float64 else loop.target.weights.dtype)
                if source_of_node is not None:  # anomaly mode records each node's forward stack
                    stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
                with tracker if tracker is not None else contextlib.nullcontext():
                    outcome: StepOutcome = loop.run(feed, options)
                # measured before the stack exits: leaving float64 puts the weights back
                record, update_ratios, _ = measure(loop, outcome, reached.step,
                                                   before=snapshot.model if ratios and not skip_update else None,
                                                   position=reached.position)
            if skip_update:   # the update was not rerun: its ratio is the replayed step's own
                record = dataclasses.replace(record, update_ratio=reached.record.update_ratio)
                update_ratios = dict(reached.step_ratios)
            note = None if outcome.precision_applied else (
                f"{precision.value} could not be applied: your step_fn enters no torch.autocast, so nanprobe has "
                "no autocast to rewrite")
            return StepTrace(precision=precision, record=record, trace=tracker.trace if tracker else None,
                             update_ratios=update_ratios, note=note, applied=outcome.precision_applied,
                             outcome=outcome)
        except UserCodeError as exc:  # e.g. an op without a kernel for this dtype on this device
            if not tolerate_errors:
                raise
            return StepTrace(precision=precision, record=None, trace=tracker.trace if tracker else None,
                             error=exc.message, exc=exc)
        finally:
            if restore_after or (cast is not None and not skip_update):
                snapshot.restore(loop.objects, partial_ok=True)

    if instrument and (loop.device_type == "cuda" if deferred is None else deferred):
        first = once({"deferred": True})
        flagged = first.trace.flagged if first.trace is not None else set()
        if not flagged:
            return first
        second = once({"only": frozenset(flagged)})
        if second.trace is not None:
            second.trace.reads += first.trace.reads
        return second
    return once(None)


class _CastFeed:
    """The recorded micro-batches with floating tensors (of dtype ``only``; all where None) cast to ``dtype``;
    every other attribute (read or set) is the inner feed's."""

    def __init__(self, inner, dtype: torch.dtype, only: torch.dtype | None):
        self.__dict__.update(inner=inner, dtype=dtype, only=only)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.inner, name, value)

    def get(self, j: int):
        item = self.inner.get(j)
        return None if item is None else map_tensors(item, lambda t: t.to(self.dtype) if t.is_floating_point()
                                                     and (self.only is None or t.dtype == self.only) else t)


def resolve_backward_source(target, reached: Reached, trace: StepTrace, *, where: str) -> StepTrace | None:
    """Give a backward origin the forward source line of its autograd node.

    Costs one more rerun with anomaly mode (check_nan=False), which records every node's forward
    stack; only the origin's node is read. Returns that rerun (None when none was needed).
    """
    origin = trace.origin
    if origin is None or origin.phase is not Phase.BACKWARD or origin.node_seq is None or origin.source:
        return None
    again = run_step(target, reached, trace.precision, where=where, source_of_node=origin.node_seq,
                     tolerate_errors=True, restore_after=False, phases=frozenset({Phase.FORWARD, Phase.BACKWARD}),
                     ratios=False, update=False)
    if again.trace is not None and again.trace.node_source:
        origin.source, origin.code = again.trace.node_source
    return again
