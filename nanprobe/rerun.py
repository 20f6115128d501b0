"""Rerun one step from a snapshot, in one precision, optionally instrumented -> StepTrace."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from .batch import clone_batch, map_tensors
from .errors import UserCodeError
from .instrument import Event, OriginTracker, Probe, Trace
from .loop import StepOutcome, batch_size, train_step
from .precision import Precision, device_of
from .replay import Reached, measure
from .report import Phase, StepRecord


@dataclass(slots=True)
class StepTrace:
    precision: Precision
    record: StepRecord | None
    trace: Trace | None
    update_ratios: dict[str, float] = field(default_factory=dict)
    error: str | None = None          # the rerun itself failed (e.g. dtype not supported here)

    @property
    def finite(self) -> bool:
        return self.record is not None and self.record.finite

    @property
    def origin(self) -> Event | None:
        return self.trace.events[0] if self.trace and self.trace.events else None


@contextlib.contextmanager
def _fp32_island(model: torch.nn.Module, module_names: str | tuple[str, ...]):
    """Run modules with autocast disabled and float32 inputs (the fix we verify)."""
    names = (module_names,) if isinstance(module_names, str) else tuple(module_names)
    modules = [m for n, m in model.named_modules() if n in names]
    device_type = device_of(model).type
    contexts: list[Any] = []

    def pre(mod, args, kwargs):
        ctx = torch.autocast(device_type, enabled=False)
        ctx.__enter__()
        contexts.append(ctx)
        cast = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def post(mod, args, kwargs, out):
        contexts.pop().__exit__(None, None, None)

    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
    try:
        yield bool(modules)
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _float64(target, snapshot):
    """Run the step in float64: parameters, buffers and gradients widened in place (same objects),
    the optimizer state reloaded (cast to float64), default dtype float64. On exit, errors too, every
    tensor gets its original dtype back; the caller's final ``snapshot.restore`` then reloads the values
    and the optimizer state (cast back to the original dtypes)."""
    model = target.model
    saved = [(t, t.dtype) for t in [*model.parameters(), *model.buffers()]
             if t.is_floating_point() and t.dtype != torch.float64]
    default = torch.get_default_dtype()

    def cast(t: torch.Tensor, dtype: torch.dtype) -> None:
        grad = t.grad if t.is_leaf else None
        if grad is not None:
            t.grad = None
        t.data = t.data.to(dtype)
        if grad is not None:
            t.grad = grad.to(dtype)

    try:
        with torch.no_grad():
            for t, _ in saved:
                cast(t, torch.float64)
        torch.set_default_dtype(torch.float64)
        snapshot.restore(target, None)  # exact values again; optimizer state follows the parameters' dtype
        yield
    finally:
        torch.set_default_dtype(default)
        with torch.no_grad():
            for t, dtype in saved:
                cast(t, dtype)


def _phases(tracker: OriginTracker | None, observe: Callable[[Phase], None] | None):
    if tracker is None:
        return observe

    def set_phase(phase: Phase) -> None:
        tracker.set_phase(phase)
        if observe is not None:
            observe(phase)

    return set_phase


def run_step(target, reached: Reached, precision: Precision, *, where: str, instrument: bool = True,
             probe: Probe | None = None, fp32_module: str | tuple[str, ...] | None = None,
             max_grad_norm: float | None = None,
             lr_scale: float | None = None, param_overrides: dict[str, Any] | None = None,
             grad_scaler: bool | None = None, tolerate_errors: bool = False,
             observe: Callable[[Phase], None] | None = None, source_of_node: int | None = None) -> StepTrace:
    """Restore the state before the step, run it once, restore again. User objects end unchanged.

    ``observe(phase)`` is called at each phase boundary (after the tracker), e.g. to read the
    gradients when the update phase begins.
    """
    device_type = device_of(target.model).type
    use_scaler = target.grad_scaler if grad_scaler is None else grad_scaler
    scaler = None
    if precision is Precision.FP16 and use_scaler and target.optimizer is not None:
        scaler = torch.amp.GradScaler(device_type)
    snapshot = reached.snapshot
    snapshot.restore(target, None)
    if scaler is not None and snapshot.scaler:
        scaler.load_state_dict(snapshot.scaler)
    saved_groups = None
    if param_overrides and target.optimizer is not None:
        saved_groups = [dict(g) for g in target.optimizer.param_groups]
        for g in target.optimizer.param_groups:
            g.update(param_overrides)
    batch = clone_batch(reached.batch)
    tracker = OriginTracker(target.model, target.optimizer,
                            low_dtype=precision.dtype if precision.low else reached.precision.dtype
                            if reached.precision.low else torch.float16,
                            batch_size=batch_size(batch), probe=probe,
                            source_of_node=source_of_node) if instrument else None
    try:
        with contextlib.ExitStack() as stack:
            if precision is Precision.FP64:  # the user's objects get their dtypes back when the stack exits
                stack.enter_context(_float64(target, snapshot))
                batch = map_tensors(batch, lambda t: t.double() if t.is_floating_point() else t)
            if source_of_node is not None:  # anomaly mode records each node's forward stack
                stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
            if fp32_module:
                stack.enter_context(_fp32_island(target.model, fp32_module))
            if tracker is not None:
                stack.enter_context(tracker)
            outcome: StepOutcome = train_step(target, batch, precision, scaler, where=where,
                                              set_phase=_phases(tracker, observe),
                                              max_grad_norm=max_grad_norm, lr_scale=lr_scale,
                                              policy=reached.policy)
        record, ratios, _ = measure(target, snapshot, outcome, reached.step)
        return StepTrace(precision=precision, record=record, trace=tracker.trace if tracker else None,
                         update_ratios=ratios)
    except UserCodeError as exc:  # e.g. an op without a kernel for this dtype on this device
        if not tolerate_errors:
            raise
        return StepTrace(precision=precision, record=None, trace=tracker.trace if tracker else None,
                         error=exc.message)
    finally:
        if saved_groups is not None:
            for g, saved in zip(target.optimizer.param_groups, saved_groups):
                g.clear()
                g.update(saved)
        snapshot.restore(target, reached.scaler)




def resolve_backward_source(target, reached: Reached, trace: StepTrace, *, where: str) -> bool:
    """Give a backward origin the forward source line of its autograd node.

    Costs one more rerun with anomaly mode (check_nan=False), which records every node's forward
    stack; only the origin's node is read. Returns whether a rerun happened.
    """
    origin = trace.origin
    if origin is None or origin.phase is not Phase.BACKWARD or origin.node_seq is None or origin.source:
        return False
    again = run_step(target, reached, trace.precision, where=where, source_of_node=origin.node_seq)
    if again.trace is not None and again.trace.node_source:
        origin.source, origin.code = again.trace.node_source
    return True
