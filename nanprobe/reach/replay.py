"""Reach the exact state just before step N: replay from step 0 (or the user's load_state) in the
user's loop order, then hand over that state, the step's recorded micro-batches and the check's view.

Every replayed step gets one cheap check (one device sync): loss, gradient norm and parameters
finite; loss and gradient-norm spikes against a running median; GradScaler's normal skips are
not failures, a long run of them is.

With ``--at N`` nothing is copied until step N; its state is captured at its start. Without
``--at`` the bad step is found first; its state is then rebuilt from a rolling snapshot (taken
every ``replay.snapshot_every`` steps) by replaying the recorded steps since, so failures born in
the optimizer update are reached as exactly as those born in the forward pass. When the user's
code raises inside a step, that step is the bad one.
"""

from __future__ import annotations

import dataclasses

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.batch import iter_tensors
from ..base.config import MonitorConfig, ReplayConfig
from ..judge.divergence import Judge
from ..base.errors import TargetError, UsageError, UserCodeError
from .feed import DataEnd, Position, Recorded, Stream
from ..judge.monitor import Monitor, Trend
from ..base.precision import Precision, device_of
from ..base.report import Status, StepRecord
from .state import RngTracker, SavedModel, Snapshot, StoragePolicy, module_tensor_attrs, set_rng
from .step import Loop, StepOutcome
from .store import TensorStore
from .target import Target, call_user


@dataclass(slots=True)
class Reached:
    """The state before the step to diagnose, the step's inputs, and what the replay saw on the way."""

    step: int
    recorded: Recorded                 # the step's micro-batches and the RNG after each fetch
    snapshot: Snapshot
    loop: Loop
    precision: Precision
    status: Status                     # what the cheap check saw at `step`
    reason: str | None                 # e.g. "loss is nan"
    record: StepRecord | None          # the check's numbers at `step` (None: the step raised)
    history: list[StepRecord] = field(default_factory=list)   # steps before `step`
    update_ratios: dict[str, float] = field(default_factory=dict)  # per parameter, the step before
    reached_by: str = "replay from step 0"
    notes: list[str] = field(default_factory=list)
    policy: str = "native"             # autocast op policy: native, or "cuda" emulated on CPU
    scheduler_kind: str | None = None  # e.g. "LambdaLR"
    scheduler_base_lrs: tuple[float, ...] = ()
    error: UserCodeError | None = None  # the user's code raised during this step
    earlier: list[StepRecord] = field(default_factory=list)  # bad steps before `step` (with --at)
    step_ratios: dict[str, float] = field(default_factory=dict)  # per parameter, the replayed step's own
    # |w| after / |w| before, per parameter, of the update of the step before (the growth of the weights)
    growth: dict[str, float] = field(default_factory=dict)
    before: list[Recorded] = field(default_factory=list)   # the recent steps' inputs, oldest first
    onset: int | None = None           # an earlier excursion that recovered (run without --at)
    compiled: bool = False             # the original step ran torch.compile'd code; the reruns are eager
    trend: Trend | None = None          # the precursor monitor's series up to `step`
    breakaway: dict[str, Any] | None = None   # the slow divergence the judge saw (divergence.breakaway's facts)

    @property
    def from_scratch(self) -> bool:
        """The state was reached by training from step 0 in this process (replay, smoke): an earlier state (the
        onset) can be reached the same way."""
        return self.reached_by.startswith(("replay from step 0", "trained from scratch"))

    @property
    def position(self) -> Position | None:
        return self.recorded.position

    @property
    def batch(self) -> Any:
        """The step's batch (one item), or the list of its micro-batches under accumulation."""
        items = self.recorded.items
        return items[0] if len(items) == 1 else list(items)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.loop.scaler

    def restore(self) -> None:
        self.snapshot.restore(self.loop.objects)


def scheduler_info(target: Target) -> dict[str, Any]:
    if not target.schedulers:
        return {}
    sched = target.schedulers[0][1]
    base = getattr(sched, "base_lrs", None) or []
    return {"scheduler_kind": type(sched).__name__,
            "scheduler_base_lrs": tuple(float(b) for b in base if isinstance(b, (int, float)))}


INPUTS_BYTES = 64 << 20   # the recent batches kept for comparing a bad step's batch with them (bytes)


# -- the per-step check -----------------------------------------------------------------------------

def _delta_norms(named: list[tuple[str, torch.Tensor]], before: SavedModel
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per parameter: |w - w_before| and |w_before|, computed through one scratch buffer per dtype
    (no parameter-sized temporary: the saved parameters are streamed one tensor at a time)."""
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for _, p in named:
        key = (p.dtype, p.device)
        sizes[key] = max(sizes.get(key, 0), p.numel())
    scratch = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
    deltas, olds = [], []
    with torch.no_grad():
        for name, p in named:
            buf = scratch[(p.dtype, p.device)][:p.numel()].view(p.shape)
            before.slot(name).copy_into(buf)
            wide = None if buf.dtype == torch.float64 else torch.float32   # an fp64 rerun keeps its precision
            olds.append(torch.linalg.vector_norm(buf, dtype=wide))
            buf.sub_(p)
            deltas.append(torch.linalg.vector_norm(buf, dtype=wide))
    return torch.stack(deltas), torch.stack(olds)


def _ratio(d: float, w: float) -> float:
    return d / w if w > 0 else (math.inf if d > 0 else 0.0)


def measure(loop: Loop, outcome: StepOutcome, step: int, *, before: SavedModel | None = None,
            position: Position | None = None, norms: dict[str, float] | None = None
            ) -> tuple[StepRecord, dict[str, float], bool]:
    """The cheap check of one finished step, read back with one device sync.

    ``before`` (the parameters the step started from: a snapshot's saved model) adds the update
    ratios |dw|/|w|; ``norms`` is filled with each parameter's norm after the step.
    """
    device = outcome.loss.device if outcome.loss is not None else device_of(loop.target.model)
    nan = torch.full((1,), math.nan, device=device)
    heads = (outcome.loss, outcome.grad_norm, outcome.found_inf, outcome.scale)
    parts = [v.float().reshape(1).to(device) if v is not None else nan for v in heads]
    named, params = loop.named_params, loop.params
    n = len(params)
    keyed = [(k, v) for k, v in outcome.losses.items() if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        if params:
            parts.append(torch.stack([x.float() for x in torch._foreach_norm(params)]).to(device))
            if before is not None:
                parts += [t.to(device) for t in _delta_norms(named, before)]
        if keyed:   # float64: the cat widens the rest exactly, and an fp64 rerun's losses stay exact
            parts.append(torch.stack([v.detach().double().reshape(()).to(device) for _, v in keyed]))
        values = torch.cat(parts).tolist()   # the one device sync
    loss, gnorm, found, scale = (v if h is not None else None for v, h in zip(values, heads))
    skipped = found is not None and found > 0
    ratios: dict[str, float] = {}
    ratio = None
    params_finite = True
    if params:
        after = values[4:4 + n]
        # an inf norm of finite weights is the norm's own overflow (sum of squares of values near 1e38):
        # those tensors (rare) are checked exactly
        params_finite = all(math.isfinite(v) or (math.isinf(v) and bool(torch.isfinite(p).all()))
                            for v, p in zip(after, params))
        if norms is not None:
            norms.update(zip((name for name, _ in named), after))
        if before is not None:
            delta, prev = values[4 + n:4 + 2 * n], values[4 + 2 * n:4 + 3 * n]
            ratios = {name: _ratio(d, w) for (name, _), d, w in zip(named, delta, prev)}
            # global |dw| / |w|: per-parameter ratios of near-zero tensors (fresh biases) are meaningless
            ratio = _ratio(math.sqrt(sum(d * d for d in delta)), math.sqrt(sum(w * w for w in prev)))
    finite = (loss is None or math.isfinite(loss)) and params_finite and (
        gnorm is None or math.isfinite(gnorm) or skipped)
    read = dict(zip((k for k, _ in keyed), values[len(values) - len(keyed):]))
    losses = {k: read[k] if k in read else float(v) for k, v in outcome.losses.items()}
    record = StepRecord(step=step, loss=loss, grad_norm=gnorm, lr=outcome.lr, update_ratio=ratio,
                        finite=finite, skipped=skipped, scale=scale,
                        epoch=position.epoch if position else None, index=position.index if position else None,
                        losses=losses)
    return record, ratios, params_finite


class NoBadStep(Exception):
    """Replay finished (data exhausted or --max-steps) without a bad step."""

    def __init__(self, steps: int, history: list[StepRecord], limit: int, *, data_ended: bool = False,
                 epochs: int | None = None, last: Reached | None = None, trend: Trend | None = None,
                 notes: list[str] | None = None):
        self.steps = steps
        self.notes = list(notes or [])   # what the judge noted on a healthy run (a loss rise with nothing behind it)
        self.trend = trend        # the precursor monitor's series of the healthy run
        self.history = history
        self.limit = limit
        self.data_ended = data_ended
        self.epochs = epochs
        self.last = last          # the state before the last replayed step (reach(keep_last=True))
        super().__init__(f"no bad step in {steps} steps")


class Replayer:
    """Runs the target's steps in order from its current state, with the cheap check."""

    def __init__(self, target: Target, *, precision: Precision, cfg: ReplayConfig, where: str,
                 policy: str = "native", monitor: MonitorConfig | None = None):
        self.target, self.cfg = target, cfg
        self.loop = Loop(target, where, precision, policy)
        self.loop.objects.storage = storage_policy(cfg)
        self.rng = RngTracker(self.loop.device_type)
        self.stream = Stream(target, self.rng)
        on = monitor is not None and monitor.enabled
        self.monitor = Monitor(target.model, monitor, dtype=precision.dtype if precision.low else None,
                               activations=True) if on else None
        self.judge = Judge(cfg, self.monitor)
        self.notes: list[str] = []
        self._observed = False
        self._buffers = [b for _, b in target.model.named_buffers()]
        self._modules = list(target.model.modules())   # walked once, not on every --at step
        self._ratio_store: TensorStore | None = None
        self._ratio_slots = None
        self.norms: deque[dict[str, float]] = deque(maxlen=3)   # parameter norms after each recent step
        self.inputs: deque[tuple[Recorded, int]] = deque(maxlen=max(cfg.history, 1))   # recent inputs, bytes
        named = self.loop.named_params
        if named:   # the norms the first update starts from (one read)
            with torch.no_grad():
                start = torch.stack([x.float() for x in torch._foreach_norm(self.loop.params)]).tolist()
            self.norms.append(dict(zip((n for n, _ in named), start)))

    def light(self) -> tuple[dict[str, Any], Callable[[], None]]:
        """The RNG now, and what undoes a step that raises before any update (buffers, train flags, gradients)."""
        rng, flags = self.rng.capture(), [(m, m.training) for m in self._modules]
        buffers = [(b, b.detach().clone()) for b in self._buffers]

        def undo() -> None:
            with torch.no_grad():
                for live, saved in buffers:
                    live.copy_(saved)
            for m, flag in flags:
                m.training = flag
            set_rng(rng)
            for _, opt in self.loop.target.optimizers:
                opt.zero_grad(set_to_none=True)
        return rng, undo

    def params(self) -> SavedModel:
        """The parameters now, saved for the update ratio of one step: in the snapshots' store (a file
        for large CPU states), reused from step to step."""
        named = self.loop.named_params
        if self._ratio_store is None:
            nbytes = sum(p.numel() * p.element_size() for _, p in named)
            self._ratio_store = self.loop.objects.storage.new_store(self.loop.device_type, nbytes)
        self._ratio_slots = self._ratio_store.put_all(self.loop.params, reuse=self._ratio_slots)
        return SavedModel([(n, p, slot) for (n, p), slot in zip(named, self._ratio_slots)])

    def run(self, feed, *, before: SavedModel | None = None
            ) -> tuple[StepOutcome, StepRecord, dict[str, float], bool]:
        """Run one live step and check it."""
        self.rng.begin_step()
        watched = self.monitor is not None and self.monitor.begin(feed.step)
        try:
            outcome = self.loop.run(feed)
        except BaseException:
            if watched:
                self.monitor.abort()
            raise
        finally:
            self.rng.end_step()
        if not self._observed:
            self._observed = True
            self._observe(outcome)
        norms: dict[str, float] = {}
        record, ratios, params_finite = measure(self.loop, outcome, feed.step, before=before,
                                                position=feed.position, norms=norms)
        self.norms.append(norms)
        if watched:
            self.monitor.end(feed.step, loss=record.loss, grad_norm=record.grad_norm, lr=record.lr,
                             scale=record.scale, optimizers=[o for _, o in self.target.optimizers])
        return outcome, record, ratios, params_finite

    def remember(self, rec: Recorded) -> None:
        """Keep a step's inputs for the comparison of a bad step's batch with the ones before it (at most
        ``history`` steps and INPUTS_BYTES of tensors: the batches are referenced, not copied)."""
        size = sum(t.numel() * t.element_size() for item in rec.items for _, t in iter_tensors(item))
        self.inputs.append((rec, size))
        while len(self.inputs) > 1 and sum(n for _, n in self.inputs) > INPUTS_BYTES:
            self.inputs.popleft()

    def seen(self, k: int, recorded: Recorded, status: Status, reason: str | None, record: StepRecord | None,
             history, error: UserCodeError | None = None) -> Reached:
        """Step ``k`` as judged, with the inputs before it and the growth of the update before it (the state
        before it comes with :func:`_reached`)."""
        growth: dict[str, float] = {}   # |w| after / |w| before per parameter
        back = 1 if record is not None else 0
        if len(self.norms) >= back + 2:
            after, prev = self.norms[-1 - back], self.norms[-2 - back]
            sizes = sorted(v for v in prev.values() if math.isfinite(v))
            floor = sizes[len(sizes) // 2] if sizes else 0.0   # small tensors (fresh biases) grow by large factors
            growth = {n: after[n] / prev[n] for n in after
                      if prev.get(n) and prev[n] >= floor and math.isfinite(after[n])}
        return Reached(step=k, recorded=recorded, snapshot=None, loop=self.loop, precision=self.loop.precision,
                       status=status, reason=reason, record=record, history=list(history), policy=self.loop.policy,
                       error=error, growth=growth, before=[rec for rec, _ in self.inputs if rec.step < k])

    def _observe(self, outcome: StepOutcome) -> None:
        """After the first step: what the step function really trains in, and state kept on modules."""
        if self.target.step_fn is not None and outcome.autocast:
            seen = outcome.autocast[0]
            observed = {"bfloat16": Precision.BF16, "float16": Precision.FP16}.get(seen)
            if observed is not None and observed is not self.loop.precision:
                self.notes.append(f"your step_fn trains under torch.autocast({seen}); the target says "
                                  f"{self.loop.precision.value}: using {observed.value}")
                self.loop.precision = observed
        self.loop.objects.attrs = module_tensor_attrs(self.target.model)


def storage_policy(cfg: ReplayConfig) -> StoragePolicy:
    return StoragePolicy(mode=cfg.snapshot_store, memory_mb=cfg.snapshot_memory_mb,
                         directory=cfg.snapshot_dir or None)


def reach(target: Target, *, at: int | None, precision: Precision, cfg: ReplayConfig, where: str,
          max_steps: int | None = None, on_progress: Callable[[int], None] | None = None,
          policy: str = "native", keep_last: bool = False, excursions: bool = False,
          monitor: MonitorConfig | None = None) -> Reached:
    """Replay to step ``at`` (or to the first bad step) and return the state before it.

    The target's objects are left in that state. Without a bad step, NoBadStep is raised; with
    ``keep_last`` it carries the state before the last replayed step. With ``excursions`` (``run``
    without ``--at``), a spike decided at once that comes back to normal within ``persist_steps``
    steps is an excursion: it is noted and the replay goes on to the first failure that does not
    recover (that failure's ``onset`` is the excursion); when nothing fails after it, the excursion
    itself is the step returned.
    """
    if at is not None and (isinstance(at, bool) or at < 0):
        raise UsageError(f"--at {at} is negative", "--at", "Give a step number >= 0")
    if max_steps is not None and max_steps < 1:
        raise UsageError(f"--max-steps {max_steps} is not a positive number of steps", "--max-steps",
                         "Give N >= 1")
    if at is not None and max_steps is not None and at >= max_steps:
        raise UsageError(f"--at {at} is beyond --max-steps {max_steps}", "--at",
                         "Raise --max-steps, or give a step below it")
    r = Replayer(target, precision=precision, cfg=cfg, where=where, policy=policy, monitor=monitor)
    start, reached_by = 0, "replay from step 0"
    notes: list[str] = []
    if at is not None and target.load_state is not None:
        restored = call_user(f"load_state({at})", target.load_state, at)
        if isinstance(restored, bool) or not isinstance(restored, int) or not 0 <= restored <= at:
            raise TargetError(f"load_state({at}) returned {restored!r}", where,
                              f"Return the step your checkpoint restores, an int between 0 and {at}")
        start, reached_by = restored, f"load_state({at}) -> step {restored}, then replay"
        notes.append("RNG state comes from your checkpoint code; nanprobe replays from there deterministically.")
        try:
            r.stream.skip(start)
        except DataEnd:
            raise UsageError(f"batches ran out at step {r.stream.next_step}, before the checkpoint's step {start}",
                             where, "Give batches that reach the checkpoint's step") from None
    try:
        if at is not None:
            return _reach_at(r, at, start, reached_by, notes, on_progress)
        limit = max_steps if max_steps is not None else cfg.max_steps
        return _reach_first_bad(r, start, limit, reached_by, notes, on_progress, keep_last, excursions)
    finally:
        r.stream.close()


def _open(r: Replayer, k: int):
    try:
        return r.stream.open(k)
    except DataEnd:
        return None


@dataclass(slots=True)
class _Watch:
    """A bad step (or a spike decided at once, replayed past to see whether it recovers) and the rolling
    snapshot and logged steps that rebuild the state before it."""

    seen: Reached                     # from Replayer.seen: no snapshot yet
    rolling: Snapshot
    log: list[Recorded]
    left: int = 0                     # steps still to watch


def _reached(r: Replayer, seen: Reached, snap: Snapshot, ratios: dict[str, float], reached_by: str,
             notes: list[str], **more) -> Reached:
    return dataclasses.replace(seen, snapshot=snap, precision=r.loop.precision, update_ratios=ratios,
                               reached_by=reached_by, notes=notes + r.notes, breakaway=r.judge.breakaway,
                               trend=r.monitor.trend if r.monitor is not None else None, **scheduler_info(r.target),
                               **more)


def _raised(exc: UserCodeError, k: int, position: Position | None) -> str:
    where = position.describe() if position else f"step {k}"
    return f"{exc.during} raised {type(exc.exc).__name__} at {where}"


def _reach_at(r: Replayer, at: int, start: int, reached_by: str, notes: list[str],
              on_progress: Callable[[int], None] | None) -> Reached:
    history: deque[StepRecord] = deque(maxlen=max(r.cfg.history, 1))
    earlier: list[StepRecord] = []
    ratios: dict[str, float] = {}
    ratio_from = at - max(r.cfg.ratio_steps, 0)
    for k in range(start, at + 1):
        feed = _open(r, k)
        if feed is None:
            epochs = f" ({r.stream.epoch + 1} epoch(s) of {r.target.epochs})" if not r.stream.callable else ""
            raise UsageError(f"batches ran out at step {k}{epochs}, before --at {at}", r.loop.where,
                             "Give a step the data reaches, raise 'epochs', or make batches longer")
        rng, undo = r.light() if k < at else (None, None)
        snap = r.loop.objects.take() if k == at else None   # step at: its state, and its own update ratios
        before = snap.model if k == at else r.params() if k >= ratio_from and r.cfg.ratio_steps > 0 else None
        record, step_ratios, error = None, {}, None
        try:
            _, record, step_ratios, params_finite = r.run(feed, before=before)
            status, reason = r.judge.judge(record, params_finite)
        except UserCodeError as exc:
            status, reason, error = Status.NONFINITE, _raised(exc, k, feed.position), exc
            if k < at:   # the step raised: it is the bad step (the run cannot go past it); undo what it did
                if r.loop.updates_in_step:
                    raise UsageError(f"{reason}, after an optimizer update, before --at {at}", r.loop.where,
                                     f"Run without --at (nanprobe then rebuilds the state before step {k})") from exc
                undo()
                snap = r.loop.objects.take(rng=rng)
                notes.append(f"step {k} raised before --at {at}: diagnosing step {k} (the run cannot get past it)")
        if snap is not None:
            if k == at:
                snap.restore(r.loop.objects)
            recorded = Recorded.of(feed) if error is None else Recorded.of_partial(feed)
            w = r.seen(k, recorded, status, reason, record, history, error=error)
            return _reached(r, w, snap, ratios, reached_by, notes, earlier=earlier, step_ratios=step_ratios)
        r.remember(Recorded(step=k, items=list(feed.items), position=feed.position))
        if status is not Status.FINITE:
            earlier.append(record)
            if len(earlier) <= 3:   # the first three are noted
                notes.append(f"step {record.step} was already bad ({reason}); diagnosing --at {at} as asked "
                             f"(nanprobe run --at {k} diagnoses step {k})")
        if on_progress:
            on_progress(k)
        r.judge.add(record)
        history.append(record)
        ratios = step_ratios
    raise AssertionError("unreachable")  # pragma: no cover


def _excursion_note(w: Reached, back: StepRecord) -> str:
    prev = [h.loss for h in w.history[-3:] if h.loss is not None]
    jump = ""
    if prev and w.record.loss is not None and min(prev) > 0:
        jump = f"loss {prev[-1]:.3g} -> {w.record.loss:.3g} (x{w.record.loss / prev[-1]:.3g}); "
    moved = ""
    if w.growth:
        name = max(w.growth, key=lambda n: abs(math.log(w.growth[n])) if w.growth[n] > 0 else math.inf)
        if not 0.9 < w.growth[name] < 1.1:
            moved = f"the update before it took {name} |w| x{w.growth[name]:.3g}; "
    return (f"step {w.step} was an excursion that recovered: {jump}{moved}back to normal at step {back.step} "
            f"(loss {back.loss:.3g}) [{w.reason}]")


def _reach_first_bad(r: Replayer, start: int, limit: int, reached_by: str, notes: list[str],
                     on_progress: Callable[[int], None] | None, keep_last: bool = False,
                     excursions: bool = False) -> Reached:
    history: deque[StepRecord] = deque(maxlen=max(r.cfg.history, 1))
    every = max(r.cfg.snapshot_every, 1)
    rolling: Snapshot | None = None
    log: list[Recorded] = []
    watch: _Watch | None = None     # a spike being watched for recovery
    first: _Watch | None = None     # the first excursion that recovered (kept to diagnose if nothing fails)
    k = start

    def rebuilt(w: _Watch, extra: list[str] = ()) -> Reached:
        """The state before ``w``'s step (rebuilt from its snapshot); a recovered excursion before it is its onset."""
        snap, ratios = _rebuild(r, w.rolling, w.log, w.seen.history)
        out = _reached(r, w.seen, snap, ratios, reached_by, notes + list(extra))
        if first is not None and first is not w:
            out.onset = first.seen.step
        return out

    def here(recorded: Recorded, status: Status, reason: str | None, record: StepRecord | None,
             error: UserCodeError | None = None) -> Reached:
        return rebuilt(_Watch(r.seen(k, recorded, status, reason, record, history, error), rolling, log))

    while True:
        feed = _open(r, k) if k - start < limit else None
        if feed is None:   # the data ran out, or the --max-steps limit
            ended = k - start < limit
            if first is None:
                last = None   # with keep_last: the state before the last replayed step
                if keep_last and log:
                    last = rebuilt(_Watch(r.seen(history[-1].step, log[-1], Status.FINITE, None, history[-1],
                                                 list(history)[:-1]), rolling, log[:-1]))
                raise NoBadStep(k - start, list(history), limit, data_ended=ended, last=last,
                                epochs=r.stream.epoch + 1 if ended and not r.stream.callable else None,
                                trend=r.monitor.trend if r.monitor is not None else None, notes=r.judge.notes)
            ran = "the data ran out" if ended else f"the --max-steps limit {limit}"
            return rebuilt(first, [f"nothing failed after it in the {k - first.seen.step - 1} steps to {ran}: "
                                   f"diagnosing the excursion at step {first.seen.step}"])
        if watch is None and (rolling is None or len(log) >= every):
            # the state at step k's start; its first micro-batch is already fetched, and replaying the
            # log puts the RNG where that fetch left it, so the snapshot may be taken after it (the
            # snapshot an excursion is rebuilt from is kept)
            rolling = r.loop.objects.take(reuse=None if first is not None and first.rolling is rolling else rolling)
            log = []
        try:
            _, record, _, params_finite = r.run(feed)
        except UserCodeError as exc:
            if watch is not None:   # a step that raises right after a spike: the spike did not recover
                return rebuilt(watch)
            return here(Recorded.of_partial(feed), Status.NONFINITE, _raised(exc, k, feed.position), None, exc)
        recorded = Recorded.of(feed)
        status, reason = r.judge.judge(record, params_finite)
        if on_progress:
            on_progress(k)
        if watch is not None:
            if status is Status.NONFINITE and first is not None:
                # after an excursion that recovered, a spike is judged by what follows it: it ran into
                # non-finite values, and the first non-finite step is the failure, with the excursion as onset
                notes.append(f"step {watch.seen.step} did not recover ({watch.seen.reason}); step {k} is non-finite")
                return here(recorded, status, reason, record)
            if status is not Status.FINITE:
                return rebuilt(watch)   # it did not recover: the spike is the failure
            if r.judge.back_to_normal(record):
                notes.append(_excursion_note(watch.seen, record))
                if first is None:
                    first = watch
                watch = None
            else:
                watch.left -= 1
                if watch.left <= 0:
                    return rebuilt(watch)
        elif status is not Status.FINITE:
            if not (excursions and status is Status.SPIKE and r.judge.at_once()):
                return here(recorded, status, reason, record)
            watch = _Watch(r.seen(k, recorded, status, reason, record, history), rolling, list(log),
                           left=max(r.cfg.persist_steps, 1))
        log.append(recorded)
        r.judge.add(record, excursion=watch is not None and watch.seen.step == k)
        history.append(record)
        r.remember(recorded)
        k += 1


def _rebuild(r: Replayer, rolling: Snapshot, log: list[Recorded],
             history: list[StepRecord]) -> tuple[Snapshot, dict[str, float]]:
    """The state before the step after ``log``: the rolling snapshot, then the logged steps again.

    Returns the snapshot and the per-parameter update ratios of the step before; that step's global
    update ratio goes into its ``history`` row (the replay itself measures none: it copies nothing).
    """
    rolling.restore(r.loop.objects)
    if not log:
        return rolling, {}
    for rec in log[:-1]:
        r.loop.run(rec.feed())   # no fetch: the state goes where the live run took it
    rec, before = log[-1], r.params()
    last, ratios, _ = measure(r.loop, r.loop.run(rec.feed()), rec.step, before=before, position=rec.position)
    if history and history[-1].step == last.step:   # the log and the history end at the same step
        history[-1] = dataclasses.replace(history[-1], update_ratio=last.update_ratio)
    return r.loop.objects.take(reuse=rolling), ratios   # the rolling snapshot's storage is not needed again


__all__ = ["Reached", "reach", "NoBadStep", "measure", "Judge", "Replayer", "scheduler_info"]
