"""Is a finished step bad? Non-finite values, divergence against the run's recent history, and
runs of GradScaler skips. Replay, smoke and (through its own fast path) the Guard judge steps here.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from .config import ReplayConfig
from .report import Status, StepRecord


class Judge:
    """Non-finite values, spikes against a running median, and runs of GradScaler skips."""

    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.spike_window)
        self.norms: deque[float] = deque(maxlen=cfg.spike_window)
        self.skips = 0

    def judge(self, record: StepRecord, params_finite: bool) -> tuple[Status, str | None]:
        reason = _nonfinite_reason(record, params_finite)
        status = Status.NONFINITE if reason else Status.FINITE
        if record.skipped and _finite(record.loss) and params_finite:   # GradScaler's normal skip
            self.skips += 1
            reason, status = None, Status.FINITE
            if self.skips > self.cfg.max_scaler_skips:
                scale = f" (scale now {record.scale:g})" if record.scale is not None else ""
                reason, status = f"GradScaler skipped {self.skips} steps in a row{scale}", Status.NONFINITE
        else:
            self.skips = 0
        if reason is None:
            spike = self._spike(record.loss, None if record.skipped else record.grad_norm)
            if spike:
                reason, status = spike, Status.SPIKE
        return status, reason

    def _spike(self, loss: float | None, norm: float | None) -> str | None:
        cfg = self.cfg
        if loss is not None and len(self.losses) >= cfg.min_history:
            med = statistics.median(self.losses)
            if loss - med > (cfg.loss_spike_factor - 1) * max(abs(med), 1e-12):
                times = f"{loss / med:.1f}x" if med > 0 else "inf x"
                return f"loss spike: {loss:.4g} vs running median {med:.4g} ({times})"
        if norm is not None and len(self.norms) >= cfg.min_history:
            med = statistics.median(self.norms)
            if med > 0 and norm > cfg.grad_spike_factor * med:
                return f"gradient-norm spike: {norm:.4g} vs running median {med:.4g} ({norm / med:.1f}x)"
        return None

    def add(self, record: StepRecord) -> None:
        if _finite(record.loss):
            self.losses.append(record.loss)
        if _finite(record.grad_norm) and not record.skipped:
            self.norms.append(record.grad_norm)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _nonfinite_reason(record: StepRecord, params_finite: bool) -> str | None:
    if record.loss is not None and not math.isfinite(record.loss):
        return f"loss is {record.loss}"
    if record.grad_norm is not None and not math.isfinite(record.grad_norm) and not record.skipped:
        return f"gradient norm is {record.grad_norm}"
    if not params_finite:
        return "parameters became non-finite in the optimizer update"
    return None


__all__ = ["Judge"]
