"""Is a finished step bad? Non-finite values, divergence told apart from noise, GradScaler skip storms.

One model, shared by replay and smoke (``Judge``, over ``StepRecord``s) and by the in-loop
``nanprobe.Guard`` (``Divergence`` directly, with the loss and gradient norm it reads in its one
sync), so both decide the same on the same history. The decisions:

- **noise or divergence**: the loss and the gradient norm are each compared with robust
  statistics of a long window (median and MAD of the log, so heavy tails and losses near zero
  widen the band instead of tripping it; a rise must also exceed ``rise_floor`` of the first
  losses). A value above the *candidate* cut is only elevated: it becomes a spike when it stays
  elevated for ``persist_steps`` steps in a row (divergence does not recover, noise does), or at
  once when it is above the *extreme* cut in a *quiet* window (one whose earlier elevated values
  never recovered: a run that has shown heavy tails must show persistence too).
- **divergence from step 1** needs no history: before the window has ``min_history`` values, a
  loss ``runaway_factor`` times the largest of the first losses; and (where it was measured,
  ``run --at N``) an update |dw|/|w| above ``update_ratio_limit``.
- **GradScaler**: a skipped step with a finite loss is the scaler's normal back-off while the
  scale is still at or above ``min_scale`` and within ``max_scale_drop`` of the scale the current
  run of skips started from after training had worked; a skip below that is a storm (the values
  overflow fp16 even with the scale taken away), as is a run longer than ``max_scaler_skips``.

Cut-offs are computed when a value is added (``add``), so judging a step is a few comparisons.
What the model cannot see: a one-off NaN gradient that GradScaler skips looks like a scaled
overflow until the scale falls below ``min_scale``; a lasting shift of the data (a new shard)
looks like divergence (the classifier then reports ``data`` when LR and updates did not change).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .config import GuardConfig, ReplayConfig
from .report import Status, StepRecord

_MAD_SIGMA = 1.4826   # MAD -> standard deviation for a normal distribution


@dataclass(frozen=True, slots=True, kw_only=True)
class Rules:
    """The thresholds of the divergence model (see configs/default.yaml for each one's meaning)."""

    window: int = 50
    min_history: int = 8
    loss_factor: float = 10.0
    grad_factor: float = 100.0
    z: float = 3.0
    extreme_factor: float = 100.0
    extreme_z: float = 10.0
    persist: int = 3
    runaway_factor: float = 30.0
    baseline_steps: int = 3
    rise_floor: float = 0.05
    update_limit: float = 1.0
    min_scale: float = 1.0
    max_scale_drop: float = 1024.0
    max_scaler_skips: int = 64

    @classmethod
    def of(cls, cfg: ReplayConfig | GuardConfig) -> Rules:
        window = cfg.spike_window if isinstance(cfg, ReplayConfig) else cfg.window
        return cls(window=max(window, 1), min_history=max(cfg.min_history, 2), loss_factor=cfg.loss_spike_factor,
                   grad_factor=cfg.grad_spike_factor, z=cfg.spike_z, extreme_factor=cfg.extreme_factor,
                   extreme_z=cfg.extreme_z, persist=max(cfg.persist_steps, 1), runaway_factor=cfg.runaway_factor,
                   baseline_steps=max(cfg.baseline_steps, 1), rise_floor=cfg.rise_floor,
                   update_limit=getattr(cfg, "update_ratio_limit", math.inf), min_scale=cfg.min_scale,
                   max_scale_drop=cfg.max_scale_drop, max_scaler_skips=cfg.max_scaler_skips)


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass(frozen=True, slots=True, kw_only=True)
class Band:
    """Where a series' next value counts as elevated (``candidate``) or far out (``extreme``)."""

    median: float
    sigma: float          # robust spread: of log(value) when ``log``, else of the value
    log: bool
    candidate: float      # above: elevated (a spike once it persists)
    extreme: float        # above: a spike at once


def band(values: Iterable[float], *, factor: float, z: float, extreme_factor: float, extreme_z: float,
         floor: float = 0.0, logs: Iterable[float] | None = None) -> Band:
    """Robust cut-offs over ``values``: median and MAD of log(value) when every value is positive
    (a ratio band: heavy tails and tiny losses widen it), else of the value itself (a loss that
    crosses zero). A value must also rise more than ``floor`` above the median (absolute units).
    ``logs``: the values' logs when the caller keeps them."""
    vals = list(values)
    if min(vals) > 0:
        logs = list(logs) if logs is not None else [math.log(v) for v in vals]
        med = _median(logs)
        sigma = _MAD_SIGMA * _median([abs(x - med) for x in logs])
        m = math.exp(med)
        cand = math.exp(med + max(math.log(max(factor, 1.0)), z * sigma))
        ext = math.exp(med + max(math.log(max(extreme_factor, 1.0)), extreme_z * sigma))
        return Band(median=m, sigma=sigma, log=True, candidate=max(cand, m + floor), extreme=max(ext, m + floor))
    med = _median(vals)
    sigma = _MAD_SIGMA * _median([abs(x - med) for x in vals])
    scale = max(abs(med), sigma, floor, 1e-12)
    return Band(median=med, sigma=sigma, log=False,
                candidate=med + max((factor - 1) * scale, z * sigma, floor),
                extreme=med + max((extreme_factor - 1) * scale, extreme_z * sigma, floor))


class _Series:
    """One signal (loss or gradient norm): its window, its band, the current run of elevated steps.

    A series whose window holds elevated values that recovered has shown heavy tails: an extreme
    value there must persist like any other elevated one before it is a spike."""

    __slots__ = ("name", "factor", "values", "logs", "flags", "first", "band", "run", "run_start", "quiet")

    def __init__(self, name: str, factor: float, window: int):
        self.name = name
        self.factor = factor
        self.values: deque[float] = deque(maxlen=window)
        self.logs: deque[float] = deque(maxlen=window)   # log of each value (nan where <= 0)
        self.flags: deque[bool] = deque(maxlen=window)   # each value was elevated when it came
        self.first: list[float] = []        # the first values of the run (the no-history baseline)
        self.band: Band | None = None
        self.run = 0                         # consecutive elevated steps up to the last added one
        self.run_start: int | None = None
        self.quiet = True                    # no elevated value in the window recovered

    def baseline(self) -> float | None:
        pos = [v for v in self.first if v > 0]
        return max(pos) if pos else None

    def recovered(self) -> int:
        """Elevated values in the window that were followed by a normal one."""
        return sum(self.flags) - min(self.run, len(self.flags))

    def refresh(self, r: Rules) -> None:
        self.quiet = self.recovered() == 0
        if len(self.values) < r.min_history:
            self.band = None
            return
        base = self.baseline()
        self.band = band(self.values, factor=self.factor, z=r.z, extreme_factor=r.extreme_factor,
                         extreme_z=r.extreme_z, floor=r.rise_floor * base if base else 0.0, logs=self.logs)

    def add(self, value: float, step: int | None, r: Rules) -> None:
        elevated = self.band is not None and value > self.band.candidate
        if elevated:
            if self.run == 0:
                self.run_start = step
            self.run += 1
        else:
            self.run, self.run_start = 0, None
        if len(self.first) < r.baseline_steps:
            self.first.append(value)
        self.values.append(value)
        self.logs.append(math.log(value) if value > 0 else math.nan)
        self.flags.append(elevated)
        self.refresh(r)

    def cut(self, r: Rules) -> float:
        """The value above which the next step is a spike (extreme in a quiet series, or completing
        a persistent run)."""
        if self.band is None:
            return math.inf
        if self.run + 1 >= r.persist:
            return self.band.candidate
        return self.band.extreme if self.quiet else math.inf

    def explain(self, value: float, step: int | None, r: Rules) -> str | None:
        b = self.band
        if b is None or value <= b.candidate:
            return None
        label = "loss" if self.name == "loss" else "gradient-norm"
        times = f"{value / b.median:.1f}x" if b.median > 0 else "above"
        spread = f"{(math.log(value) - math.log(b.median)) / b.sigma:.0f} robust sigmas of log" \
            if b.log and b.sigma > 0 and value > 0 else "no spread in the window"
        head = f"{label} spike: {value:.4g} vs running median {b.median:.4g} ({times}; {spread})"
        if self.run + 1 >= r.persist:
            since = f" since step {self.run_start}" if self.run and self.run_start is not None else ""
            return (f"{head}; elevated {self.run + 1} steps in a row{since} (above {b.candidate:.4g}): "
                    "it does not recover")
        if value > b.extreme and self.quiet:
            return head + "; far outside a window whose earlier values never spiked"
        return None

    def state(self) -> dict[str, Any]:
        return {"values": list(self.values), "flags": list(self.flags), "first": list(self.first),
                "run": self.run, "run_start": self.run_start}

    def load(self, state: dict[str, Any], r: Rules) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in state.get("values", []))
        self.logs.clear()
        self.logs.extend(math.log(v) if v > 0 else math.nan for v in self.values)
        self.flags.clear()
        self.flags.extend(bool(f) for f in state.get("flags", [False] * len(self.values)))
        self.first = [float(v) for v in state.get("first", [])]
        self.run = int(state.get("run", 0))
        self.run_start = state.get("run_start")
        self.refresh(r)


class Divergence:
    """The shared decision model over plain numbers: what a step's loss, gradient norm, update ratio
    and GradScaler skip say. ``judge`` is a few comparisons; ``add`` (a step that was applied or a
    GradScaler skip) updates the statistics."""

    def __init__(self, rules: Rules):
        self.rules = rules
        self.loss = _Series("loss", rules.loss_factor, rules.window)
        self.norm = _Series("grad_norm", rules.grad_factor, rules.window)
        self.skips = 0                 # GradScaler skips in a row
        self.worked = False            # an update was applied at some point (warm-up is over)
        self.anchor: float | None = None   # the scale the current run of skips started from, after warm-up

    # -- cut-offs for the next step (the guard's device-side flag uses them) --------------------------
    def loss_cut(self) -> float:
        cut = self.loss.cut(self.rules)
        base = self.loss.baseline()
        if base is not None and self.loss.band is None:   # no robust band yet: the first losses are the baseline
            cut = min(cut, self.rules.runaway_factor * base)
        return cut

    def norm_cut(self) -> float:
        return self.norm.cut(self.rules)

    # -- decisions --------------------------------------------------------------------------------
    def spike(self, loss: float | None, norm: float | None, *, update_ratio: float | None = None,
              step: int | None = None) -> str | None:
        """Why this finite step is a spike, or None."""
        r = self.rules
        if update_ratio is not None and math.isfinite(update_ratio) and update_ratio > r.update_limit:
            return (f"update spike: |dw|/|w| = {update_ratio:.3g} in one step (limit {r.update_limit:g}; "
                    "a healthy step moves the weights by about 1e-3 of their norm)")
        if loss is not None and loss > self.loss_cut():
            why = self.loss.explain(loss, step, r)
            if why:
                return why
            base = self.loss.baseline()
            if base is not None and self.loss.band is None and loss > r.runaway_factor * base:
                return (f"loss spike: {loss:.4g} is {loss / base:.0f}x the largest of the first losses "
                        f"({base:.4g}): divergence, with no history needed")
        if norm is not None and norm > self.norm_cut():
            return self.norm.explain(norm, step, r)
        return None

    def scaler_skip(self, scale: float | None) -> str | None:
        """A GradScaler skip with a finite loss: None while it is the normal back-off, else why not."""
        r = self.rules
        self.skips += 1
        if self.skips == 1:
            self.anchor = scale if self.worked else None
        at = f" (loss scale {scale:g})" if scale is not None else ""
        if scale is not None and scale < r.min_scale:
            return (f"GradScaler skip storm: step skipped at loss scale {scale:g} (< {r.min_scale:g}) after "
                    f"{self.skips} skip(s) in a row: the values overflow fp16 even without the scale")
        if scale is not None and self.anchor is not None and scale * r.max_scale_drop <= self.anchor:
            return (f"GradScaler skip storm: {self.skips} skips in a row took the loss scale from "
                    f"{self.anchor:g}, where training worked, down to {scale:g}")
        if self.skips > r.max_scaler_skips:
            return f"GradScaler skipped {self.skips} steps in a row{at}"
        return None

    def scaler_ok(self) -> None:
        """The GradScaler did not skip this step (or there is none): a run of skips is over."""
        self.skips = 0
        self.worked = True
        self.anchor = None

    def add(self, loss: float | None, norm: float | None, *, step: int | None = None) -> None:
        """A step that goes into the history (applied, or a GradScaler skip: then ``norm`` is None)."""
        if loss is not None and math.isfinite(loss):
            self.loss.add(loss, step, self.rules)
        if norm is not None and math.isfinite(norm):
            self.norm.add(norm, step, self.rules)

    # -- state (the guard's state_dict) -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss.state(), "norm": self.norm.state(), "skips": self.skips, "worked": self.worked,
                "anchor": self.anchor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss.load(state.get("loss", {}), self.rules)
        self.norm.load(state.get("norm", {}), self.rules)
        self.skips = int(state.get("skips", 0))
        self.worked = bool(state.get("worked", False))
        self.anchor = state.get("anchor")


class Judge:
    """The per-step verdict for replay and smoke: non-finite values, spikes, GradScaler skip storms."""

    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self.model = Divergence(Rules.of(cfg))

    @property
    def skips(self) -> int:
        return self.model.skips

    def judge(self, record: StepRecord, params_finite: bool) -> tuple[Status, str | None]:
        reason = _nonfinite_reason(record, params_finite)
        if reason:
            return Status.NONFINITE, reason
        if record.skipped:   # a GradScaler skip with a finite loss
            storm = self.model.scaler_skip(record.scale)
            if storm:
                return Status.NONFINITE, storm
        else:
            self.model.scaler_ok()
        spike = self.model.spike(record.loss, None if record.skipped else record.grad_norm,
                                 update_ratio=None if record.skipped else record.update_ratio, step=record.step)
        return (Status.SPIKE, spike) if spike else (Status.FINITE, None)

    def add(self, record: StepRecord) -> None:
        self.model.add(record.loss, None if record.skipped else record.grad_norm, step=record.step)


def _nonfinite_reason(record: StepRecord, params_finite: bool) -> str | None:
    if record.loss is not None and not math.isfinite(record.loss):
        return f"loss is {record.loss}"
    if record.grad_norm is not None and not math.isfinite(record.grad_norm) and not record.skipped:
        return f"gradient norm is {record.grad_norm}"
    if not params_finite:
        return "parameters became non-finite in the optimizer update"
    return None


__all__ = ["Judge", "Divergence", "Rules", "Band", "band"]
