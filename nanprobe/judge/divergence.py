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
looks like divergence (the classifier reports ``data`` only where a key of the batch stands out
against the batches before it, else ``unknown``). ``run`` without ``--at`` asks whether a spike was
decided at once (``at_once``) and, if so, whether the next steps come ``back_to_normal``: such an
excursion is an onset, not the failure (``replay.reach(excursions=True)``).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..base.config import GuardConfig, ReplayConfig
from ..base.report import Status, StepRecord

_MAD_SIGMA = 1.4826   # MAD -> standard deviation for a normal distribution
# A full window's band is recomputed every few values (and at once around elevated values): one
# value moves a 50-value median/MAD very little, and this runs inside the guard's <= 1% budget.
REFRESH_EVERY = 4
# After an excursion decided at once, a step is back to normal within this factor of the level before it
# (or the level's own noise, where wider).
RECOVERY_FACTOR = 1.5


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


def _mid(s: list[float]) -> float:
    """The median of a sorted list."""
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _median_and_mad(s: list[float]) -> tuple[float, float]:
    """Median and median absolute deviation of a sorted list (the deviations below and above the
    median are two ascending runs: sorting them is one merge)."""
    med = _mid(s)
    i = bisect_left(s, med)
    return med, _mid(sorted([med - x for x in reversed(s[:i])] + [x - med for x in s[i:]]))


def _cut(med: float, sigma: float, log: bool, factor: float, z: float, floor: float) -> float:
    """``factor`` times the median or ``z`` robust sigmas above it, whichever is wider, and at least ``floor``
    above it (absolute units). ``med`` and ``sigma`` are of log(value) when ``log`` (every value positive: a
    ratio band, heavy tails and tiny losses widen it), else of the value itself (a loss that crosses zero)."""
    if log:
        return max(math.exp(med + max(math.log(max(factor, 1.0)), z * sigma)), math.exp(med) + floor)
    scale = max(abs(med), sigma, floor, 1e-12)
    return med + max((factor - 1) * scale, z * sigma, floor)


class _Series:
    """One signal (loss or gradient norm): its window, its band, the current run of elevated steps.

    A series whose window holds elevated values that recovered has shown heavy tails: an extreme
    value there must persist like any other elevated one before it is a spike. The window is also
    kept sorted (values, and logs of the positive ones), so a new band costs one merge, not a sort;
    the cut-offs are plain floats (this runs once per step inside the guard's budget).

    ``flags``: each value was elevated when it came; ``sorted_logs``: logs of the positive values;
    ``first``: the first values of the run (the no-history baseline), ``floor``: rise_floor x the
    baseline; ``run``: consecutive elevated steps up to the last added one; ``quiet``: no elevated value
    in the window recovered; ``ready``: the window has min_history values (the band exists); ``age``:
    values added since the band was computed."""

    __slots__ = ("name", "factor", "r", "values", "flags", "sorted_vals", "sorted_logs", "first", "floor", "run",
                 "run_start", "quiet", "ready", "median", "sigma", "log", "candidate", "extreme", "next_cut", "age")

    def __init__(self, name: str, factor: float, rules: Rules):
        self.name, self.factor, self.r = name, factor, rules
        self.values: deque[float] = deque()
        self.flags: deque[bool] = deque()
        self.median = self.sigma = 0.0
        self.log = True
        self.age = 0
        self.load({})   # an empty window: no band yet

    def baseline(self) -> float | None:
        pos = [v for v in self.first if v > 0]
        return max(pos) if pos else None

    def recovered_cut(self) -> float:
        """Where a value is back to the level before an excursion: within ``RECOVERY_FACTOR`` of the median (or
        its own noise, ``z`` robust sigmas, where that is wider). A loss that falls from 305 back to 12-60
        after 6 has not recovered, though it is under the 10x spike cut."""
        r = self.r
        if self.log:   # ``median`` is the level itself, ``sigma`` the spread of its log
            return max(self.median * math.exp(max(math.log(RECOVERY_FACTOR), r.z * self.sigma)),
                       self.median + self.floor)
        return _cut(self.median, self.sigma, False, RECOVERY_FACTOR, r.z, self.floor)

    def refresh(self, force: bool = True) -> None:
        """Recompute the band (when ``force``, when it is ``REFRESH_EVERY`` values old, or when the
        window is not yet full-grown) and the next step's cut."""
        r = self.r
        self.quiet = sum(self.flags) == min(self.run, len(self.flags))   # every elevated value is in the current run
        if len(self.values) < r.min_history:
            self.ready = False
            self.candidate = self.extreme = self.next_cut = math.inf
            return
        self.age += 1
        if force or not self.ready or self.age >= REFRESH_EVERY or len(self.values) < r.window:
            self.age = 0
            self.ready = True
            self.log = len(self.sorted_logs) == len(self.sorted_vals)   # no value <= 0
            med, mad = _median_and_mad(self.sorted_logs if self.log else self.sorted_vals)
            self.sigma = _MAD_SIGMA * mad
            self.median = math.exp(med) if self.log else med
            self.candidate = _cut(med, self.sigma, self.log, self.factor, r.z, self.floor)
            self.extreme = _cut(med, self.sigma, self.log, r.extreme_factor, r.extreme_z, self.floor)
        # the value above which the next step is a spike: completing a persistent run, or extreme in a
        # quiet series
        self.next_cut = self.candidate if self.run + 1 >= r.persist else (self.extreme if self.quiet else math.inf)

    def _push(self, value: float, flag: bool) -> None:
        if len(self.values) >= self.r.window:
            old = self.values.popleft()
            self.flags.popleft()
            del self.sorted_vals[bisect_left(self.sorted_vals, old)]
            if old > 0:
                del self.sorted_logs[bisect_left(self.sorted_logs, math.log(old))]
        self.values.append(value)
        self.flags.append(flag)
        insort(self.sorted_vals, value)
        if value > 0:
            insort(self.sorted_logs, math.log(value))

    def add(self, value: float, step: int | None, elevated: bool | None = None) -> None:
        """``elevated``: force the value's flag (an excursion that recovered, added while the band did not
        exist yet: the window has shown it does not stay quiet)."""
        elevated = value > self.candidate if elevated is None else elevated
        if elevated:
            if self.run == 0:
                self.run_start = step
            self.run += 1
        else:
            self.run, self.run_start = 0, None
        if len(self.first) < self.r.baseline_steps:
            self.first.append(value)
            base = self.baseline()
            self.floor = self.r.rise_floor * base if base else 0.0
        self._push(value, elevated)
        self.refresh(force=elevated or (len(self.flags) >= 2 and self.flags[-2]))   # in or just after a run

    def explain(self, value: float, step: int | None) -> str | None:
        if not self.ready or value <= self.candidate:
            return None
        med = self.median
        times = f"{value / med:.1f}x" if med > 0 else "above"
        spread = f"{(math.log(value) - math.log(med)) / self.sigma:.0f} robust sigmas of log" \
            if self.log and self.sigma > 0 and value > 0 else "no spread in the window"
        head = f"{self.name} spike: {value:.4g} vs running median {med:.4g} ({times}; {spread})"
        if self.run + 1 >= self.r.persist:
            since = f" since step {self.run_start}" if self.run and self.run_start is not None else ""
            return (f"{head}; elevated {self.run + 1} steps in a row{since} (above {self.candidate:.4g}): "
                    "it does not recover")
        if value > self.extreme and self.quiet:
            return head + "; far outside a window whose earlier values never spiked"
        return None

    def state(self) -> dict[str, Any]:
        return {"values": list(self.values), "flags": list(self.flags), "first": list(self.first),
                "run": self.run, "run_start": self.run_start}

    def load(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.flags.clear()
        self.sorted_vals, self.sorted_logs = [], []
        values = [float(v) for v in state.get("values", [])]
        for v, f in zip(values, state.get("flags", [False] * len(values))):
            self._push(v, bool(f))
        self.first = [float(v) for v in state.get("first", [])]
        base = self.baseline()
        self.floor = self.r.rise_floor * base if base else 0.0
        self.run = int(state.get("run", 0))
        self.run_start = state.get("run_start")
        self.refresh()


class Divergence:
    """The shared decision model over plain numbers: what a step's loss, gradient norm, update ratio
    and GradScaler skip say. ``judge`` is a few comparisons; ``add`` (a step that was applied or a
    GradScaler skip) updates the statistics."""

    def __init__(self, rules: Rules):
        self.rules = rules
        self.loss = _Series("loss", rules.loss_factor, rules)
        self.norm = _Series("gradient-norm", rules.grad_factor, rules)
        self.skips = 0                 # GradScaler skips in a row
        self.worked = False            # an update was applied at some point (warm-up is over)
        self.anchor: float | None = None   # the scale the current run of skips started from, after warm-up
        self.at_once = False           # the last spike was decided at once (no history, extreme, update), not
                                       # by persistence: whether it recovers is still open

    # -- cut-offs for the next step (the guard's device-side flag uses them) --------------------------
    def loss_cut(self) -> float:
        # no robust band yet: the first losses are the baseline
        base = None if self.loss.ready else self.loss.baseline()
        return self.loss.next_cut if base is None else min(self.loss.next_cut, self.rules.runaway_factor * base)

    def norm_cut(self) -> float:
        return self.norm.next_cut

    # -- decisions --------------------------------------------------------------------------------
    def spike(self, loss: float | None, norm: float | None, *, update_ratio: float | None = None,
              step: int | None = None) -> str | None:
        """Why this finite step is a spike, or None."""
        r = self.rules
        self.at_once = True
        if update_ratio is not None and math.isfinite(update_ratio) and update_ratio > r.update_limit:
            return (f"update spike: |dw|/|w| = {update_ratio:.3g} in one step (limit {r.update_limit:g}; "
                    "a healthy step moves the weights by about 1e-3 of their norm)")
        if loss is not None and loss > self.loss_cut():
            why = self.loss.explain(loss, step)
            if why:
                self.at_once = self.loss.run + 1 < r.persist
                return why
            base = self.loss.baseline()
            if base is not None and not self.loss.ready and loss > r.runaway_factor * base:
                return (f"loss spike: {loss:.4g} is {loss / base:.0f}x the largest of the first losses "
                        f"({base:.4g}): divergence, with no history needed")
        if norm is not None and norm > self.norm_cut():
            self.at_once = self.norm.run + 1 < r.persist
            return self.norm.explain(norm, step)
        return None

    def back_to_normal(self, loss: float | None, norm: float | None) -> bool:
        """After an excursion: this finite step's loss and gradient norm are back under the cuts (the band's
        candidate cut, or the no-history runaway cut)."""
        def under(series: _Series, value: float | None, runaway: float | None) -> bool:
            if value is None:
                return True
            if not math.isfinite(value):
                return False
            if series.ready:
                return value <= series.recovered_cut()
            base = series.baseline()
            return runaway is None or base is None or value <= runaway * base
        return under(self.loss, loss, self.rules.runaway_factor) and under(self.norm, norm, None)

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

    def add(self, loss: float | None, norm: float | None, *, step: int | None = None,
            excursion: bool = False) -> None:
        """A step that goes into the history (applied, or a GradScaler skip: then ``norm`` is None).
        ``excursion``: the step is a spike whose recovery is being watched; it counts as elevated."""
        if loss is not None and math.isfinite(loss):
            self.loss.add(loss, step, True if excursion else None)
        if norm is not None and math.isfinite(norm):
            self.norm.add(norm, step)

    # -- state (the guard's state_dict) -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss.state(), "norm": self.norm.state(), "skips": self.skips, "worked": self.worked,
                "anchor": self.anchor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss.load(state.get("loss", {}))
        self.norm.load(state.get("norm", {}))
        self.skips = int(state.get("skips", 0))
        self.worked = bool(state.get("worked", False))
        self.anchor = state.get("anchor")


class Breakaway:
    """A slow divergence, step by step: the loss level (the median of the last ``window`` losses) left
    the best level it reached by more than ``sigmas`` noise sigmas (robust, of the step-to-step
    changes) and ``rise`` of the best level's magnitude, and stayed above for ``patience`` steps.

    A spike that recovers, a cosine restart's bump and a noisy plateau come back; this does not.
    """

    def __init__(self, *, window: int = 10, sigmas: float = 4.0, rise: float = 0.1, patience: int = 20,
                 min_steps: int = 30):
        self.window, self.sigmas, self.rise = max(window, 1), sigmas, rise
        self.patience, self.min_steps = max(patience, 1), min_steps
        self.recent: deque[float] = deque(maxlen=self.window)
        self.diffs: list[float] = []        # |loss_t - loss_t-1|, sorted
        self.healthy: list[float] = []      # the same, while the loss was reaching its best level: a healthy run's noise
        self.last: float | None = None
        self.best: float | None = None
        self.best_step: int | None = None
        self.above_since: int | None = None
        self.n = 0

    def add(self, loss: float, step: int) -> dict[str, Any] | None:
        """Add a finite loss; the break-away's facts when the run has broken away, else None."""
        if loss is None or not math.isfinite(loss):
            return None
        self.n += 1
        if self.last is not None:
            insort(self.diffs, abs(loss - self.last))
            if self.best_step is None or step <= self.best_step + 1:
                insort(self.healthy, abs(loss - self.last))
        self.last = loss
        self.recent.append(loss)
        if len(self.recent) < self.window:
            if len(self.recent) == EARLY and self.best is None:
                # the first losses' level: a run that leaves it within its first window (the loss jumps 4x at
                # step 3 and never comes back) has left its best level too
                self.best, self.best_step = _mid(sorted(self.recent)), step
            return None
        level = _mid(sorted(self.recent))
        if self.best is None or level < self.best:
            self.best, self.best_step, self.above_since = level, step, None
            return None
        sigma, cut = self.noise(), self.cut()
        if level <= cut:
            self.above_since = None
            return None
        if self.above_since is None:
            self.above_since = step
        if step - self.above_since + 1 < self.patience or self.n < self.min_steps:
            return None
        return {"best": self.best, "best_step": self.best_step, "level": level, "step": step,
                "since": self.above_since, "sigma": sigma, "cut": cut}

    def noise(self) -> float:
        """The loss's noise sigma: robust, of its step-to-step changes; those of the healthy stretch (while the
        loss was reaching its best level) where they are smaller (a diverged loss's own noise would widen the cut
        that tells it apart from its best level)."""
        if not self.diffs:
            return 0.0
        mid = min(_mid(self.diffs), _mid(self.healthy)) if len(self.healthy) >= EARLY else _mid(self.diffs)
        return _MAD_SIGMA * mid / math.sqrt(2)

    def cut(self) -> float | None:
        """The level above which the loss has left its best level (None before a full window)."""
        return None if self.best is None else self.best + max(self.sigmas * self.noise(), self.rise * abs(self.best))

    @staticmethod
    def describe(facts: dict[str, Any]) -> str:
        return (f"slow divergence: the loss broke away from its best level {facts['best']:.4g} (step "
                f"{facts['best_step']}) at step {facts['since']} and has not come back: {facts['level']:.4g} at "
                f"step {facts['step']} ({facts['level'] - facts['best']:+.3g}, noise sigma {facts['sigma']:.2g})")


def breakaway(losses: Iterable[float] | Iterable[tuple[int, float]], **settings: Any) -> dict[str, Any] | None:
    """Did a loss series leave its own best level and not come back?

    ``losses``: plain values (step = position) or ``(step, loss)`` pairs; non-finite values are
    skipped. Returns None, or the first break-away found: ``{"best", "best_step", "level", "step",
    "since", "sigma", "cut"}`` (the best level and its step, the level when it was judged, the step
    judged, the first step above the cut, the noise sigma and the cut). ``settings``: ``Breakaway``'s
    (window, sigmas, rise, patience, min_steps: ``monitor.breakaway_*`` in configs/default.yaml).
    """
    b = Breakaway(**settings)
    for i, item in enumerate(losses):
        step, loss = item if isinstance(item, tuple) else (i, item)
        facts = b.add(float(loss), int(step))
        if facts is not None:
            return facts
    return None


EARLY = 3   # the first losses whose median is a best level before a full window exists

# A break-away is a failure only with a second, independent signal behind it. The gradient norm's level over
# the break-away against its level where the loss was best: this many times higher is a sustained rise.
GRAD_RISE = 10.0
# ... and this many times lower is a collapse: the loss rose and the gradients died with it (dead ReLUs, saturated
# outputs): the run stopped learning
GRAD_COLLAPSE = 5.0


class Judge:
    """The per-step verdict for replay and smoke: non-finite values, spikes, GradScaler skip storms,
    and (with a ``monitor``) a loss that broke away from its best level.

    A break-away alone is a note (``notes``), not a failure: a KL weight ramping up, a value loss growing
    with the returns, a curriculum step all raise the loss of a healthy run. It is ``diverging`` when a
    second, independent signal stands behind it: the gradient norm's sustained rise (``GRAD_RISE``), or
    what the precursor monitor finds (``monitor``: its series, :meth:`Trend.precursor`: a precursor out of its
    band, an update that climbs the gradient). Replay, smoke and the live step core all judge with it."""

    def __init__(self, cfg: ReplayConfig | GuardConfig, monitor: Any = None):
        self.model = Divergence(Rules.of(cfg))
        # ``monitor`` (a judge.monitor.Monitor): the slow divergence too, by its break-away settings
        self.monitor = monitor
        c = getattr(monitor, "cfg", None)   # the break-away of ``monitor.breakaway_*`` (configs/default.yaml)
        self.slow = None if monitor is None else Breakaway(
            window=c.breakaway_window, sigmas=c.breakaway_sigmas, rise=c.breakaway_rise,
            patience=c.breakaway_patience, min_steps=c.breakaway_min_steps)
        self.breakaway: dict[str, Any] | None = None
        self.notes: list[str] = []
        self.rise: dict[str, Any] | None = None     # the first break-away with nothing behind it
        self.norms: deque[tuple[int, float]] = deque(maxlen=4096)   # applied steps' gradient norms

    def behind(self, facts: dict[str, Any]) -> str | None:
        """The independent signal behind a break-away, or None."""
        since, best = facts["since"], facts["best_step"]
        now = [v for k, v in self.norms if k >= since]
        healthy = [v for k, v in self.norms if best - self.slow.window < k <= best]
        if len(now) >= 5 and healthy:
            a, b = _mid(sorted(healthy)), _mid(sorted(now))
            if a > 0 and b >= GRAD_RISE * a:
                return (f"the gradient norm rose with it: level {b:.3g} since step {since} against {a:.3g} where "
                        f"the loss was best ({b / a:.0f}x)")
            if b > 0 and a >= GRAD_COLLAPSE * b:
                return (f"the gradient norm collapsed with it: level {b:.3g} since step {since} against {a:.3g} where "
                        f"the loss was best ({a / b:.0f}x lower): the model stopped learning (dead or saturated units)")
        return self.monitor.trend.precursor(facts, self.slow.patience)

    def judge(self, record: StepRecord, params_finite: bool) -> tuple[Status, str | None]:
        if record.loss is not None and not math.isfinite(record.loss):
            return Status.NONFINITE, f"loss is {record.loss}"
        if record.grad_norm is not None and not math.isfinite(record.grad_norm) and not record.skipped:
            return Status.NONFINITE, f"gradient norm is {record.grad_norm}"
        if not params_finite:
            return Status.NONFINITE, "parameters became non-finite in the optimizer update"
        if record.skipped:   # a GradScaler skip with a finite loss
            storm = self.model.scaler_skip(record.scale)
            if storm:
                return Status.NONFINITE, storm
        else:
            self.model.scaler_ok()
        spike = self.model.spike(record.loss, None if record.skipped else record.grad_norm,
                                 update_ratio=None if record.skipped else record.update_ratio, step=record.step)
        if spike:
            return Status.SPIKE, spike
        facts = self.slow.add(record.loss, record.step) if self.slow is not None and record.loss is not None else None
        why = self.behind(facts) if facts is not None else None
        if why is not None:
            self.breakaway = {**facts, "signal": why}
            return Status.DIVERGING, f"{Breakaway.describe(facts)}; {why}"
        if facts is not None and self.rise is None:
            self.rise = facts
            self.notes.append(f"the loss rose from its best level {facts['best']:.4g} (step {facts['best_step']}) to "
                              f"{facts['level']:.4g} at step {facts['step']}, with nothing behind it: no precursor "
                              "out of its band, no sustained rise of the gradient norm, no update that climbs the "
                              "gradient. A note, not a failure (a loss weight ramping up, a curriculum step or a "
                              "value loss growing with the returns rise like this)")
        return Status.FINITE, None

    def add(self, record: StepRecord, *, excursion: bool = False) -> None:
        norm = None if record.skipped else record.grad_norm
        self.model.add(record.loss, norm, step=record.step, excursion=excursion)
        if norm is not None and math.isfinite(norm) and record.step is not None:
            self.norms.append((record.step, norm))

    def at_once(self) -> bool:
        """The last spike was decided at once, not by persistence: it may still recover."""
        return self.model.at_once

    def back_to_normal(self, record: StepRecord) -> bool:
        return record.finite and self.model.back_to_normal(record.loss, None if record.skipped else record.grad_norm)


__all__ = ["Judge", "Divergence", "Rules", "Breakaway", "breakaway"]
