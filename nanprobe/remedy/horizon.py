"""Fix verification over a horizon: a fix is verified when it holds for the rest of the run.

A fix is applied from outside the user's code (a :class:`Remedy`) and trained forward from the
state before the onset (the top finding's ``onset``; else the state before the failing step N)
through N + ``horizon.margin`` steps, on the same batches as the unfixed run. The horizon fails
on a non-finite value or a spike (the replay's :class:`~nanprobe.judge.divergence.Judge`) and on a slow
divergence (the loss leaves its best level and does not come back). A fix that fails with a
non-finite value gets its new origin from one instrumented rerun of the failing step.

The state before N is the replay's own; a state before an earlier onset is reached by building
the target again and replaying it to the onset (once per diagnosis). The unfixed run is not
trained where the replay's history already covers the horizon up to a non-finite failing step;
elsewhere it is trained once, up to its first non-finite step (a slow divergence runs to the end).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.config import Config
from ..judge.divergence import Breakaway, Judge
from ..base.errors import NanprobeError, UserCodeError
from ..reach.feed import DataEnd, Recorded, Stream
from ..base.precision import device_of
from .change import Remedy
from ..reach.replay import Reached, Replayer, measure
from ..base.report import Fix, Status, StepRecord
from ..locate.rerun import run_step
from ..reach.state import RngTracker, Snapshot


# -- slow divergence --------------------------------------------------------------------------------

def _fed(losses: list[tuple[int, float | None]], sigmas: float, rise: float, patience: int) -> Breakaway:
    b = Breakaway(window=5, sigmas=sigmas, rise=rise, patience=patience, min_steps=10)
    for step, loss in losses:
        if loss is not None:
            b.add(loss, step)
    return b


def broke_away(losses: list[tuple[int, float]], *, sigmas: float = 4.0, rise: float = 0.1) -> int | None:
    """The step where the loss left its best level for good within the horizon: ``divergence.Breakaway``
    (the replay's slow-divergence test, with its ``monitor.breakaway_sigmas`` / ``breakaway_rise``) sized to
    a horizon - a running median of 5, above the best level from that step through the last one, for at
    least 5 steps. None when it did not (or came back before the horizon ended)."""
    b = _fed(losses, sigmas, rise, patience=5)
    if not losses or b.above_since is None or b.n < b.min_steps or losses[-1][0] - b.above_since + 1 < b.patience:
        return None
    return b.above_since


def left_before(history: list[tuple[int, float]], *, sigmas: float = 4.0,
                rise: float = 0.1) -> tuple[float, int, float] | None:
    """(best level, its step, the cut above it) when the run had already left its best level before the
    horizon began (a lookback shorter than the divergence): a fix that holds must bring it back under
    the cut. None when the run was at its best level (or its history is too short to say)."""
    b = _fed(history, sigmas, rise, patience=1)
    if b.above_since is None or b.best is None or b.n < b.min_steps:
        return None
    return b.best, b.best_step, b.cut()


def best_level(losses: list[tuple[int, float | None]], window: int = 5) -> tuple[float, int, float] | None:
    """(the best level, its step, the level's noise) of a run's losses: the lowest running median of ``window``
    losses (of all of them, when there are fewer), and the robust sigma of one median from the step-to-step
    changes. None without a finite loss."""
    vals = [(k, v) for k, v in losses if v is not None and math.isfinite(v)]
    if not vals:
        return None
    window = min(window, len(vals))   # an onset in the first steps: the level of the few losses before it
    levels = [(statistics.median(v for _, v in vals[i - window + 1:i + 1]), vals[i][0])
              for i in range(window - 1, len(vals))]
    best, step = min(levels)
    diffs = [abs(b - a) for (_, a), (_, b) in zip(vals, vals[1:])]
    sigma = 1.4826 * statistics.median(diffs) / math.sqrt(2) if diffs else 0.0
    return best, step, sigma / math.sqrt(window)


def kept_learning(losses: list[tuple[int, float]], best: tuple[float, int, float] | None) -> str | None:
    """None when the run's last 5 losses (median) are at or below the unfixed run's best level before the
    horizon, within noise (3 sigmas of a 5-step level, or 5% of the level); else why not: a fix that avoids
    the failure by not training has not fixed it."""
    if best is None or len(losses) < 5:
        return None
    now = statistics.median(v for _, v in losses[-5:])
    level, step, sigma = best
    tol = max(3 * sigma, 0.05 * abs(level))
    if now <= level + tol:
        return None
    if len(losses) >= 10 and now < statistics.median(v for _, v in losses[:5]) - tol:   # learning, slowly
        return (f"not yet back at the unfixed run's best level {level:.3g} (step {step}) by the horizon's end: its "
                f"loss ends at {now:.3g} and is still falling")
    return (f"stopped learning: its loss ends at {now:.3g}, above the unfixed run's best level {level:.3g} "
            f"(step {step}) by more than the noise ({tol:.2g})")


def came_back(losses: list[tuple[int, float]], level: tuple[float, int, float]) -> str | None:
    """None when the run's last 5 losses (median) are back under the cut of :func:`left_before`, else
    why not."""
    if not losses:
        return None
    now = statistics.median(v for _, v in losses[-5:])
    best, step, cut = level
    if now <= cut:
        return None
    return (f"the loss did not come back to the run's best level before the horizon ({best:.3g} at step {step}; "
            f"{now:.3g} over its last steps): the run had already left it when the horizon began")


# -- one horizon ------------------------------------------------------------------------------------

@dataclass(slots=True)
class Run:
    """One training run over the horizon (fixed or not)."""

    losses: list[tuple[int, float]] = field(default_factory=list)   # (step, loss) while finite
    failed_at: int | None = None
    reason: str | None = None
    error: str | None = None            # the run itself could not train (the user's code raised)
    new_origin: dict[str, Any] | None = None
    steps: int = 0                      # steps trained

    @property
    def last(self) -> int | None:
        return self.losses[-1][0] if self.losses else None


def _tail_mean(losses: list[tuple[int, float]], upto: int | None = None, n: int = 5) -> float | None:
    vals = [v for k, v in losses if upto is None or k <= upto][-n:]
    return sum(vals) / len(vals) if vals else None


class Horizon:
    """Steps ``start``..``end`` from one saved state, trained once per remedy on the same batches."""

    def __init__(self, loaded, reached: Reached, cfg: Config, start: int, *,
                 progress: Callable[[str], None] = lambda msg: None):
        self.cfg, self.reached, self.progress = cfg, reached, progress
        self.failing = reached.step
        self.start = start
        self.end = reached.step + cfg.horizon.margin
        self.where = loaded.where
        self.precision, self.policy = reached.precision, reached.policy
        self.recorded: dict[int, Recorded] = {}
        self.notes: list[str] = []
        self.data_end: int | None = None          # the last step the data reaches, once seen
        self._own_snapshot = start != reached.step
        if start == reached.step:
            self.target, self.loop, self.snapshot = reached.loop.target, reached.loop, reached.snapshot
            self.prefix = history = list(reached.history)
            self.recorded[start] = reached.recorded
            self.rng = RngTracker(self.loop.device_type)
            self.stream = Stream(self.target, self.rng, record=False)
            try:
                self.stream.skip(start + 1)
            except DataEnd:
                self.data_end = start
            self.stream.record = True
        else:   # build the target again and replay it to ``start`` (the state before the onset)
            from ..reach.entry import load_target
            device = device_of(reached.loop.target.model)
            fresh = load_target(loaded.entry, device=None if device.type == "cpu" else str(device))
            progress(f"replaying to step {start} (the onset) for the horizon")
            r = Replayer(fresh.target, precision=self.precision, cfg=cfg.replay, where=self.where, policy=self.policy)
            history: list[StepRecord] = [r.run(r.stream.open(k))[1] for k in range(start)]
            self.target, self.loop, self.stream, self.rng = fresh.target, r.loop, r.stream, r.rng
            self.loop.precision = self.precision
            self.snapshot = self.loop.objects.take()
            self.prefix = history[-cfg.replay.spike_window:]
            self.check_same([(h.step, h.loss) for h in history])
        m = cfg.monitor
        before = [(h.step, h.loss) for h in history if h.loss is not None and h.step < start]
        # level (left_before): the run had broken away already; best: the unfixed run's best level before the start
        self.level = left_before(before, sigmas=m.breakaway_sigmas, rise=m.breakaway_rise)
        self.best = best_level(before)
        bk = reached.breakaway   # the replay saw the whole run: its best level before the break-away
        if bk is not None and bk["best_step"] < start and (self.best is None or bk["best"] < self.best[0]):
            self.best = (bk["best"], bk["best_step"], bk["sigma"] / math.sqrt(5))

    def check_same(self, losses: list[tuple[int, float | None]]) -> None:
        """The steps the replay also ran must give the same losses (else the horizon is another run)."""
        known = {h.step: h.loss for h in self.reached.history}
        for step, loss in losses:
            want = known.get(step)
            if want is not None and loss is not None and not math.isclose(want, loss, rel_tol=1e-4):
                self.notes.append(f"the horizon's unfixed run does not reproduce the replay (loss {loss:.4g} "
                                  f"vs {want:.4g} at step {step}): building the target again gave another run")
                return

    def known_unfixed(self) -> Run | None:
        """The unfixed run where the replay already says how it went: every step from the start to a
        non-finite failing step is in its history (nothing past a non-finite step is worth training)."""
        r = self.reached
        steps = {h.step: h for h in r.history}
        if r.status is not Status.NONFINITE or r.record is None or any(k not in steps
                                                                      for k in range(self.start, r.step)):
            return None
        return Run(losses=[(k, steps[k].loss) for k in range(self.start, r.step)], failed_at=r.step,
                   reason=r.reason, steps=0)

    def close(self) -> None:
        self.stream.close()
        if self._own_snapshot:
            self.snapshot.release()

    # -- training ---------------------------------------------------------------------------------
    def _step(self, k: int, remedy: Remedy):
        """Train step ``k`` on its recorded batches, else on the stream's (recorded now); None past the data."""
        live = k not in self.recorded
        if live and self.data_end is not None and k > self.data_end:
            return None
        try:
            feed = self.stream.open(k) if live else self.recorded[k].feed()
        except DataEnd:
            self.data_end = k - 1
            return None
        self.rng.begin_step()
        try:
            outcome = self.loop.run(feed, remedy.options(self.precision, self.policy, self.loop, k))
        finally:
            self.rng.end_step()
        if live:
            self.recorded[k] = Recorded.of(feed)
        return outcome

    def run(self, remedy: Remedy | None) -> Run:
        """Train the horizon with ``remedy`` (None: unfixed) from the saved state."""
        remedy = remedy or Remedy()
        out = Run()
        self.snapshot.restore(self.loop.objects)
        judge = Judge(self.cfg.replay)
        for rec in self.prefix:
            judge.add(rec)
        every = max(self.cfg.horizon.snapshot_every, 1)
        rolling: Snapshot | None = None
        rolling_at = self.start
        name_origin = False
        try:
            with remedy.applied(self.target) as added:
                for k in range(self.start, self.end + 1):
                    if (k - self.start) % every == 0:
                        rolling, rolling_at = self.loop.objects.take(reuse=rolling), k
                    outcome = self._step(k, remedy)
                    if outcome is None:
                        break
                    if not outcome.precision_applied:
                        out.error = (f"{remedy.precision.value if remedy.precision else 'the precision'} could not be "
                                     "applied: your step_fn enters no torch.autocast for nanprobe to rewrite")
                        break
                    out.steps += 1
                    record, _, params_finite = measure(self.loop, outcome, k)
                    if added:
                        z = float(torch.stack(added).sum())
                        added.clear()
                        if record.loss is not None:
                            record = dataclasses.replace(record, loss=record.loss - z)
                    status, reason = judge.judge(record, params_finite)
                    if status is not Status.FINITE:
                        out.failed_at, out.reason = k, reason
                        name_origin = status is Status.NONFINITE and remedy != Remedy()
                        break
                    judge.add(record)
                    out.losses.append((k, record.loss))
            if name_origin and rolling is not None:
                out.new_origin = self._origin(remedy, out.failed_at, rolling, rolling_at)
        except UserCodeError as exc:
            out.error = exc.message
        finally:
            if rolling is not None:
                rolling.release()
        if out.failed_at is None and out.error is None:
            slow = broke_away(out.losses, sigmas=self.cfg.monitor.breakaway_sigmas,
                              rise=self.cfg.monitor.breakaway_rise)
            if slow is not None:
                out.failed_at, out.reason = slow, "the loss left its best level and did not come back"
            elif self.level is not None and out.losses and out.last > self.failing:
                why = came_back(out.losses, self.level)
                if why is not None:
                    out.failed_at, out.reason = out.last, why
        return out

    def _origin(self, remedy: Remedy, k: int, rolling: Snapshot, at: int) -> dict[str, Any] | None:
        """The op that went non-finite at step ``k`` with the remedy: one instrumented rerun of that step."""
        self.progress(f"rerunning step {k} instrumented (where the fix failed)")
        rolling.restore(self.loop.objects)
        with remedy.applied(self.target):
            for j in range(at, k):
                self._step(j, remedy)
        before = self.loop.objects.take()
        try:
            at_k = Reached(step=k, recorded=self.recorded[k], snapshot=before, loop=self.loop,
                           precision=remedy.precision or self.precision, status=Status.NONFINITE, reason=None,
                           record=None, policy=self.policy)
            with remedy.applied(self.target):
                t = run_step(self.target, at_k, at_k.precision, where=self.where, tolerate_errors=True,
                             restore_after=False, max_grad_norm=remedy.max_grad_norm, lr_scale=remedy.lr_at(k),
                             param_overrides=dict(remedy.param_overrides) or None, ratios=False)
        finally:
            before.release()
        e = t.origin
        return None if e is None else {"module": e.module, "op": e.op, "phase": e.phase.value, "kind": e.kind}


# -- verdicts ---------------------------------------------------------------------------------------

def _fmt(x: float | None) -> str:
    return "nan" if x is None else f"{x:.3g}"


def verdict(h: Horizon, fixed: Run, unfixed: Run) -> tuple[bool | None, str, dict[str, Any]]:
    """(verified, note, verification) of one fix's run against the unfixed one."""
    stop = h.end if h.data_end is None else min(h.end, h.data_end)   # the data may end first
    info: dict[str, Any] = {"horizon": stop - h.start + 1, "from_step": h.start, "to_step": stop,
                            "steps": fixed.steps, "held": False, "failed_at": fixed.failed_at,
                            "loss_fixed": None, "loss_unfixed": None, "unfixed_failed_at": unfixed.failed_at,
                            "new_origin": fixed.new_origin}
    if fixed.error is not None:
        info["error"] = fixed.error
        return None, f"could not train the horizon with it: {fixed.error}", info
    if fixed.failed_at is not None:
        info["reason"] = fixed.reason
        info["loss_fixed"] = _tail_mean(fixed.losses, fixed.failed_at)
        o = fixed.new_origin
        where = (f": new origin {o['phase']} {o['module'] or 'model'} {o['op']}" + (f" ({o['kind']})" if o["kind"]
                 else "")) if o else f": {fixed.reason}"
        return False, f"failed at step {fixed.failed_at}{where}", info
    last = fixed.last
    if last is None or last <= h.failing:
        return None, (f"trained only to step {last} (the data ends there): a rerun of step {h.failing} alone "
                      "does not show that a fix holds"), info
    stopped = kept_learning(fixed.losses, h.best)   # None where h.best is None
    if stopped is not None:
        info["reason"] = stopped
    info["loss_fixed"] = _tail_mean(fixed.losses)
    if h.best is not None:
        info["best_before"] = h.best[0]
    if stopped is not None:
        if stopped.startswith("not yet back"):   # learning, slower than the horizon: neither held nor failed
            return None, (f"not verified: trained to step {last} without failing, but {stopped} (a longer "
                          "horizon.margin would tell)"), info
        return False, f"trained to step {last} without failing, but {stopped}", info
    info["held"] = True
    covered = unfixed.last is not None and unfixed.last >= last   # the unfixed run trained the same steps
    info["loss_unfixed"] = _tail_mean(unfixed.losses, last) if covered else None
    if not covered:
        versus = f"unfixed: {unfixed.reason or 'failed'} at step {unfixed.failed_at}"
    elif unfixed.failed_at is not None:
        versus = f"{_fmt(info['loss_unfixed'])} unfixed, which diverged from step {unfixed.failed_at}"
    else:
        versus = f"{_fmt(info['loss_unfixed'])} unfixed"
    return True, f"held for {fixed.steps} steps, to step {last} (loss {_fmt(info['loss_fixed'])} vs {versus})", info


def horizon_start(reached: Reached, onset: int | None, cfg: Config) -> int:
    """The first step of the horizon: the onset where the replay reached it, else the failing step N
    (N - 1 for a spike: its loss is the weights' answer to the update before it)."""
    n = reached.step
    if not reached.from_scratch:
        return n
    latest = n - 1 if reached.status is Status.SPIKE and n > 0 else n
    if onset is None or onset >= latest:
        return latest
    return max(onset, n - max(cfg.horizon.max_lookback, 0))


def verify_over_horizon(loaded, reached: Reached, onset: int | None, candidates: list[tuple[Fix, Remedy | None]],
                        cfg: Config, progress: Callable[[str], None] = lambda msg: None) -> list[Fix]:
    """Each candidate fix with its verdict: up to ``horizon.max_fixes`` automated fixes are trained over
    the horizon in rank order; when none held, the top two together. The rest say why not."""
    if reached.error is not None:
        return [dataclasses.replace(f, verify_note="not verified: the step raised (train past it first)")
                if r is not None else f for f, r in candidates]
    start = horizon_start(reached, onset, cfg)
    try:
        h = Horizon(loaded, reached, cfg, start, progress=progress)
    except NanprobeError as exc:
        if start == reached.step:
            return [dataclasses.replace(f, verify_note=f"not verified: the horizon could not start ({exc})")
                    if r is not None else f for f, r in candidates]
        h = Horizon(loaded, reached, cfg, reached.step, progress=progress)   # the state the replay holds
        h.notes.append(f"the horizon starts at the failing step: reaching the onset {start} failed ({exc})")
    out: list[Fix] = []
    try:
        unfixed = h.known_unfixed()
        if unfixed is None:
            progress(f"training the horizon, steps {h.start}-{h.end}, unfixed")
            unfixed = h.run(None)
            h.check_same(unfixed.losses)
        tried: list[tuple[Fix, Remedy]] = []
        budget = max(cfg.horizon.max_fixes, 0)
        runs: dict[Remedy, Run] = {}
        for fix, remedy in candidates:
            why = "it changes your code in a way nanprobe cannot apply from outside" if remedy is None \
                else remedy.why_not(h.target)
            if why is None and remedy not in runs and len(runs) >= budget:
                why = f"{budget} fixes were trained over the horizon (horizon.max_fixes)"
            if why is not None:
                keep = remedy is None and fix.verify_note
                out.append(dataclasses.replace(fix, verify_note=fix.verify_note if keep else f"not verified: {why}"))
                continue
            if remedy not in runs:
                progress(f"training the horizon with {remedy.describe()}")
                runs[remedy] = h.run(remedy)
            verified, note, info = verdict(h, runs[remedy], unfixed)
            out.append(dataclasses.replace(fix, verified=verified, verify_note=note, verification=info))
            tried.append((fix, remedy))
        held = any(f.verified for f in out)
        if not held and len(tried) >= 2 and len(runs) < budget + 1:
            (fa, ra), (fb, rb) = tried[0], tried[1]
            both = ra.combine(rb)
            if both is not None and both not in runs:
                progress(f"training the horizon with {both.describe()}")
                runs[both] = h.run(both)
                verified, note, info = verdict(h, runs[both], unfixed)
                code = f"# 1. {fa.title}\n{fa.code}\n\n# 2. {fb.title}\n{fb.code}"
                out.append(Fix(title=f"Both: {fa.title[0].lower()}{fa.title[1:]}; and {fb.title[0].lower()}"
                                     f"{fb.title[1:]}", code=code, why="neither held alone over the horizon",
                               verified=verified, verify_note=note, verification=info))
        if h.notes:
            out = [dataclasses.replace(f, verify_note=f"{f.verify_note}; {h.notes[0]}")
                   if f.verification is not None else f for f in out]
    finally:
        h.close()
    return out


__all__ = ["Horizon", "Run", "verify_over_horizon", "horizon_start", "verdict"]
