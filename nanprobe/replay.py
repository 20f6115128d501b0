"""Reach the exact state just before step N: deterministic replay from step 0, or the user's load_state.

Every replayed step gets a cheap check (one device sync): loss, gradient norm and updated
parameters finite; loss and gradient-norm spikes against a running median. GradScaler's normal
skipped steps are not failures; a long run of them is.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .batch import clone_batch
from .config import ReplayConfig
from .errors import TargetError, UsageError, UserCodeError
from .loop import Snapshot, StepOutcome, make_scaler, train_step
from .precision import Precision, device_of
from .report import Status, StepRecord
from .target import Target, call_user


@dataclass(slots=True)
class Reached:
    """The state before the step to diagnose, and what the replay saw on the way."""

    step: int
    batch: Any
    snapshot: Snapshot
    precision: Precision
    scaler: torch.amp.GradScaler | None
    status: Status                     # what the cheap check saw at `step`
    reason: str | None                 # e.g. "loss is nan"
    record: StepRecord | None          # the check's numbers at `step`
    history: list[StepRecord] = field(default_factory=list)   # steps before `step`
    update_ratios: dict[str, float] = field(default_factory=dict)  # per parameter, the step before
    reached_by: str = "replay from step 0"
    notes: list[str] = field(default_factory=list)
    policy: str = "native"             # autocast op policy: native, or "cuda" emulated on CPU
    scheduler_kind: str | None = None  # e.g. "LambdaLR"
    scheduler_base_lrs: tuple[float, ...] = ()


def batch_source(target: Target) -> Callable[[int], Any]:
    """step -> batch; step k uses the k-th batch of a fresh iterator (or batches(k))."""
    batches = target.batches
    if callable(batches) and not isinstance(batches, Iterable):
        return lambda step: call_user(f"batches({step})", batches, step)
    it: Iterator[Any] = call_user("iter(batches)", iter, batches)
    position = 0

    def get(step: int) -> Any:  # called with consecutive steps from `start`
        nonlocal position
        while position < step:
            call_user("next(batches)", next, it)
            position += 1
        position += 1
        return call_user("next(batches)", next, it)

    return get


def scheduler_info(target: Target) -> dict[str, Any]:
    sched = target.scheduler
    if sched is None:
        return {}
    base = getattr(sched, "base_lrs", None) or []
    return {"scheduler_kind": type(sched).__name__,
            "scheduler_base_lrs": tuple(float(b) for b in base if isinstance(b, (int, float)))}


class _Spikes:
    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.spike_window)
        self.norms: deque[float] = deque(maxlen=cfg.spike_window)

    def check(self, loss: float | None, norm: float | None) -> str | None:
        reason = None
        if loss is not None and len(self.losses) >= self.cfg.min_history:
            med = statistics.median(self.losses)
            if loss - med > (self.cfg.loss_spike_factor - 1) * max(abs(med), 1e-12):
                reason = f"loss spike: {loss:.4g} vs running median {med:.4g} ({loss / med if med > 0 else math.inf:.1f}x)"
        if reason is None and norm is not None and len(self.norms) >= self.cfg.min_history:
            med = statistics.median(self.norms)
            if med > 0 and norm > self.cfg.grad_spike_factor * med:
                reason = f"gradient-norm spike: {norm:.4g} vs running median {med:.4g} ({norm / med:.1f}x)"
        return reason

    def add(self, loss: float | None, norm: float | None) -> None:
        if loss is not None and math.isfinite(loss):
            self.losses.append(loss)
        if norm is not None and math.isfinite(norm):
            self.norms.append(norm)


def _params(target: Target) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in target.model.named_parameters()]


def measure(target: Target, before: Snapshot, outcome: StepOutcome, step: int, *,
            updates: bool = True) -> tuple[StepRecord, dict[str, float], bool]:
    """The cheap check of one finished step, with one device sync."""
    named = [(n, p) for n, p in _params(target) if n in before.model]
    params = [p.detach() for _, p in named]
    parts = [outcome.loss.float().reshape(1)]
    parts.append((outcome.grad_norm.float() if outcome.grad_norm is not None
                  else torch.zeros((), device=outcome.loss.device)).reshape(1))
    n = len(params)
    if params and updates:
        old = [before.model[name] for name, _ in named]
        parts.append(torch.stack(torch._foreach_norm(params)).float())
        parts.append(torch.stack(torch._foreach_norm(torch._foreach_sub(params, old))).float())
        parts.append(torch.stack(torch._foreach_norm(old)).float())
    values = torch.cat([p.to(outcome.loss.device) for p in parts]).tolist()
    loss, gnorm = values[0], values[1] if outcome.grad_norm is not None else None
    ratios: dict[str, float] = {}
    params_finite = True
    ratio = None
    if params and updates:
        after, delta, prev = values[2:2 + n], values[2 + n:2 + 2 * n], values[2 + 2 * n:2 + 3 * n]
        params_finite = all(math.isfinite(v) for v in after)
        for (name, _), d, w in zip(named, delta, prev):
            ratios[name] = d / w if w > 0 else (math.inf if d > 0 else 0.0)
        # global |dw| / |w|: per-parameter ratios of near-zero tensors (fresh biases) are meaningless
        total_w = math.sqrt(sum(w * w for w in prev))
        total_d = math.sqrt(sum(d * d for d in delta))
        ratio = total_d / total_w if total_w > 0 else (math.inf if total_d > 0 else 0.0)
    finite = math.isfinite(loss) and params_finite and (gnorm is None or math.isfinite(gnorm) or outcome.skipped)
    record = StepRecord(step=step, loss=loss, grad_norm=gnorm, lr=outcome.lr, update_ratio=ratio,
                        finite=finite, skipped=outcome.skipped, scale=outcome.scale)
    return record, ratios, params_finite


def _reason(record: StepRecord, params_finite: bool) -> str | None:
    if not math.isfinite(record.loss):
        return f"loss is {record.loss}"
    if record.grad_norm is not None and not math.isfinite(record.grad_norm) and not record.skipped:
        return f"gradient norm is {record.grad_norm}"
    if not params_finite:
        return "parameters became non-finite in the optimizer update"
    return None


def reach(target: Target, *, at: int | None, precision: Precision, cfg: ReplayConfig, where: str,
          max_steps: int | None = None, on_progress: Callable[[int], None] | None = None,
          policy: str = "native") -> Reached:
    """Replay to step ``at`` (or to the first bad step) and return the state before it."""
    if at is not None and at < 0:
        raise UsageError(f"--at {at} is negative", "--at", "Give a step number >= 0")
    device_type = device_of(target.model).type
    scaler = make_scaler(target, precision, device_type)
    start, reached_by, notes = 0, "replay from step 0", []
    if at is not None and target.load_state is not None:
        restored = call_user(f"load_state({at})", target.load_state, at)
        if isinstance(restored, bool) or not isinstance(restored, int) or not 0 <= restored <= at:
            raise TargetError(f"load_state({at}) returned {restored!r}", where,
                              f"Return the step your checkpoint restores, an int between 0 and {at}")
        start, reached_by = restored, f"load_state({at}) -> step {restored}, then replay"
        notes.append("RNG state comes from your checkpoint code; nanprobe replays from there deterministically.")
    limit = max_steps if max_steps is not None else cfg.max_steps
    get_batch = batch_source(target)
    spikes = _Spikes(cfg)
    history: deque[StepRecord] = deque(maxlen=max(cfg.history, 1))
    ratios: dict[str, float] = {}
    skips = 0
    step = start
    while True:
        if at is None and step - start >= limit:
            raise NoBadStep(step, list(history), limit)
        try:
            batch = get_batch(step)
        except UserCodeError as exc:
            if not isinstance(exc.exc, StopIteration):
                raise
            if at is not None:
                raise UsageError(f"batches ran out at step {step}, before --at {at}", where,
                                 "Give a step that the data reaches, or make batches longer") from None
            raise NoBadStep(step, list(history), limit) from None
        pristine = clone_batch(batch)
        snap = Snapshot.take(target, scaler)
        outcome = train_step(target, batch, precision, scaler, where=where, policy=policy)
        record, step_ratios, params_finite = measure(target, snap, outcome, step)
        reason = _reason(record, params_finite)
        status = Status.NONFINITE if reason else Status.FINITE
        if record.skipped and math.isfinite(record.loss):  # GradScaler's normal skip: overflowed scaled grads
            skips += 1
            reason = None
            status = Status.FINITE
            if skips > cfg.max_scaler_skips:
                reason = f"GradScaler skipped {skips} steps in a row (scale now {record.scale:g})"
                status = Status.NONFINITE
        else:
            skips = 0
        if reason is None:
            spike = spikes.check(record.loss, None if record.skipped else record.grad_norm)
            if spike:
                reason, status = spike, Status.SPIKE
        if on_progress:
            on_progress(step)
        if reason is not None or step == at:
            snap.restore(target, scaler)  # leave the objects in the state before the diagnosed step
            if at is not None and step < at:
                notes.append(f"step {step} already failed before --at {at} ({reason}); diagnosing step {step}.")
            return Reached(step=step, batch=pristine, snapshot=snap, precision=precision, scaler=scaler,
                           status=status, reason=reason, record=record, history=list(history),
                           update_ratios=ratios, reached_by=reached_by, notes=notes, policy=policy,
                           **scheduler_info(target))
        spikes.add(record.loss, record.grad_norm)
        history.append(record)
        ratios = step_ratios
        step += 1


class NoBadStep(Exception):
    """Replay finished (data exhausted or --max-steps) without a bad step."""

    def __init__(self, steps: int, history: list[StepRecord], limit: int):
        self.steps = steps
        self.history = history
        self.limit = limit
        super().__init__(f"no bad step in {steps} steps")

