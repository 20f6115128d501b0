"""The user's batches in the order their loop sees them: epochs, ``set_epoch``, accumulation.

Step ``k`` consumes the next ``accumulate`` items of the current epoch (fewer at an epoch's end:
a step never spans two epochs, as in Lightning and transformers). When an epoch's iterator ends,
the next epoch calls ``set_epoch(epoch)`` on the sampler and batch sampler where they have one,
then ``iter(batches)`` afresh, exactly as ``for epoch in range(E): for batch in loader:`` does.
A callable ``batches(i)`` gives item ``i`` (``IndexError`` or ``StopIteration`` ends the data).

Items are fetched lazily, right before the step uses them, so whatever a fetch draws from the
global RNG (a DataLoader's base seed, a shuffling sampler's seed, random transforms without
workers) happens at the same point as in the user's loop. The RNG state after each fetch is
recorded: a rerun of the step feeds clones of the same items and puts the RNG where the fetch
left it, so the step sees the same random numbers at the same points.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import IterableDataset

from ..base.batch import clone_batch
from ..base.errors import DataLoadError, UserCodeError
from .state import RngTracker, set_rng
from .target import Target, call_user


@dataclass(frozen=True, slots=True)
class Position:
    """Where a step sits in the user's data: epoch, step within the epoch, items within the epoch."""

    step: int
    epoch: int | None            # None for callable batches
    index: int                   # optimizer step within the epoch
    items: tuple[int, ...] = ()  # item indices (within the epoch; global for callable batches)

    def describe(self) -> str:
        where = f"step {self.step}"
        if self.epoch is not None:
            where += f" (epoch {self.epoch}, step {self.index} of the epoch"
            if self.items:
                where += f", batch {self.items[0]}" if len(self.items) == 1 else \
                    f", batches {self.items[0]}-{self.items[-1]}"
            where += ")"
        return where


class DataEnd(Exception):
    """The data ended before step ``step`` could start."""

    def __init__(self, step: int, epochs_done: int):
        self.step, self.epochs_done = step, epochs_done
        super().__init__(f"data ended before step {step}")


def is_callable_batches(batches: Any) -> bool:
    return callable(batches) and not isinstance(batches, Iterable)


def _epoch_hooks(batches: Any) -> list[Any]:
    """Objects whose ``set_epoch(epoch)`` the user's loop (or their framework) calls each epoch."""
    found: list[Any] = []
    bs, dataset = getattr(batches, "batch_sampler", None), getattr(batches, "dataset", None)
    for c in (batches, getattr(batches, "sampler", None), bs, getattr(bs, "sampler", None),
              dataset if isinstance(dataset, IterableDataset) else None):
        if c is not None and callable(getattr(c, "set_epoch", None)) and all(c is not f for f in found):
            found.append(c)
    return found


def epoch_length(batches: Any) -> int | None:
    """Items per epoch without iterating (``len``), or None."""
    if is_callable_batches(batches):
        return None
    try:
        return len(batches)   # an int >= 0, or it raises
    except (TypeError, NotImplementedError):
        return None


class Stream:
    """Steps of micro-batches from the target's ``batches``, in the user's loop order."""

    def __init__(self, target: Target, rng: RngTracker | None = None, *, record: bool = True):
        self.record = record      # keep pristine clones of the items (False: scan-data, which only reads them)
        self.end_note: str | None = None
        self.target = target
        self.callable = is_callable_batches(target.batches)
        self.rng = rng
        self.epoch = -1
        self.next_step = 0
        self._it: Iterator[Any] | None = None
        self._item = 0            # next item index within the epoch (global for callables)
        self._index = 0           # next step index within the epoch
        self._ended = True        # the current epoch's iterator is exhausted (or none started)

    # -- items ------------------------------------------------------------------------------------
    def _start_epoch(self) -> bool:
        if self.callable or self.epoch + 1 >= self.target.epochs:
            return False
        self.epoch += 1
        try:
            for obj in _epoch_hooks(self.target.batches):
                call_user(f"{type(obj).__name__}.set_epoch({self.epoch})", obj.set_epoch, self.epoch)
            self._it = call_user("iter(batches)", iter, self.target.batches)
        except UserCodeError as exc:
            raise DataLoadError(exc.during, exc.exc) from exc.exc
        self._item = 0
        self._index = 0
        self._ended = False
        return True

    def _fetch(self) -> tuple[bool, Any]:
        """The next item of the current epoch: ``(True, item)``, or ``(False, None)`` at its end."""
        i = self._item
        if self.callable:
            during, fn, arg, ends = f"batches({i})", self.target.batches, i, (IndexError, StopIteration)
        elif self._ended or self._it is None:
            return False, None
        else:
            during, fn, arg, ends = "next(batches)", next, self._it, StopIteration
        try:
            item = call_user(during, fn, arg)
        except UserCodeError as exc:
            if not isinstance(exc.exc, ends):
                raise DataLoadError(exc.during, exc.exc) from exc.exc
            self._ended = True
            if self.callable:
                self.end_note = f"batches({i}) raised {type(exc.exc).__name__}: taken as the end of the data"
            return False, None
        self._item += 1
        return True, item

    def open(self, step: int) -> LiveFeed:
        """The feed of step ``step`` (the next one); raises DataEnd when no item is left for it."""
        if step != self.next_step:
            raise ValueError(f"the stream is at step {self.next_step}, not {step}")
        return LiveFeed(self, step)

    def close(self) -> None:
        """Let go of the current epoch's iterator now (a DataLoader's workers shut down here)."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):   # the user's loader, already done with
                shutdown()
        self._ended = True

    def skip(self, step: int) -> None:
        """Consume the items of every step before ``step`` without training (after a user checkpoint)."""
        while self.next_step < step:
            self.open(self.next_step).finish()


class LiveFeed:
    """One step's micro-batches, fetched from the stream on first use; records clones and RNG."""

    def __init__(self, stream: Stream, step: int):
        self.stream = stream
        self.step = step
        self.items: list[Any] = []         # pristine clones, as fetched
        self.rng_after: list[dict[str, Any]] = []
        self._live: list[Any] = []
        self._done = False
        self._epoch = stream.epoch
        self._index = stream._index
        self._first_item = stream._item
        self.on_micro: Callable[[int], None] | None = None
        if not self._next():
            raise DataEnd(step, max(stream.epoch + 1, 0))
        stream.next_step += 1
        stream._index += 1

    def _next(self) -> bool:
        """Fetch the step's next micro-batch; False at the step's end or the data's. (An item may be None: a
        step_fn that makes its own data, as RL loops do, is given ``batches=lambda step: None``.)"""
        s = self.stream
        if self._done or len(self._live) >= s.target.accumulate:
            self._done = True
            return False
        ok, item = s._fetch()
        if not ok and not self._live and s._start_epoch():   # the epoch ended before this step: the next starts it
            self._epoch, self._index, self._first_item = s.epoch, s._index, s._item
            ok, item = s._fetch()
        if not ok:
            self._done = True
            return False
        self._live.append(item)
        self.items.append(clone_batch(item) if s.record else item)
        if s.rng is not None:
            self.rng_after.append(s.rng.capture())
        return True

    @property
    def position(self) -> Position:
        return Position(step=self.step, epoch=None if self.stream.callable else self._epoch, index=self._index,
                        items=tuple(range(self._first_item, self._first_item + len(self.items))))

    def get(self, j: int) -> Any | None:
        """Micro-batch ``j`` (the item itself, as the user's loop would get it), or None past the step's end."""
        while len(self._live) <= j and self._next():
            pass
        if j >= len(self._live):
            return None
        if self.on_micro is not None:
            self.on_micro(j)
        return self._live[j]

    def finish(self) -> None:
        """Fetch the items the step did not use, so that the next step starts where the user's would."""
        while self._next():
            pass

    def count(self) -> int:
        self.finish()
        return len(self._live)


@dataclass(slots=True)
class Recorded:
    """A step's micro-batches as recorded by a LiveFeed (or read from a capsule)."""

    step: int
    items: list[Any]
    rng_after: list[dict[str, Any]] = field(default_factory=list)
    position: Position | None = None

    @classmethod
    def of(cls, feed: LiveFeed) -> Recorded:
        feed.finish()
        return cls.of_partial(feed)

    @classmethod
    def of_partial(cls, feed: LiveFeed) -> Recorded:
        """What a step that raised had fetched (a rerun raises at the same point)."""
        return cls(step=feed.step, items=list(feed.items), rng_after=list(feed.rng_after), position=feed.position)

    def feed(self) -> ReplayFeed:
        return ReplayFeed(self)


class ReplayFeed:
    """A rerun's feed: fresh clones of the recorded items; the RNG goes where each fetch left it."""

    def __init__(self, rec: Recorded):
        self.rec = rec
        self.step = rec.step
        self.on_micro: Callable[[int], None] | None = None
        self._given: dict[int, Any] = {}

    def get(self, j: int) -> Any | None:
        if j >= len(self.rec.items):
            return None
        if j not in self._given:
            if j < len(self.rec.rng_after):
                set_rng(self.rec.rng_after[j])
            self._given[j] = clone_batch(self.rec.items[j])
        if self.on_micro is not None:
            self.on_micro(j)
        return self._given[j]

    def finish(self) -> None:
        for j in range(len(self.rec.items)):
            if j not in self._given:
                self.get(j)

    def count(self) -> int:
        return len(self.rec.items)

    @property
    def position(self) -> Position | None:
        return self.rec.position


class MicroBatches(Sequence):
    """What ``step_fn`` gets as ``batch`` under ``accumulate`` > 1: the step's micro-batches, the
    first fetched before ``step_fn`` runs, the others as the step reaches them (``for micro in
    batch:``); indexable, with ``len``."""

    def __init__(self, feed: LiveFeed | ReplayFeed):
        self._feed = feed

    def __iter__(self):
        j = 0
        while (item := self._feed.get(j)) is not None:
            yield item
            j += 1

    def __getitem__(self, j):  # type: ignore[override]
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        if j < 0:
            j += len(self)
        item = self._feed.get(j)
        if item is None:
            raise IndexError(j)
        return item

    def __len__(self) -> int:
        return self._feed.count()

    def __repr__(self) -> str:
        return f"MicroBatches(step={self._feed.step})"


__all__ = ["Stream", "LiveFeed", "ReplayFeed", "Recorded", "MicroBatches", "Position", "DataEnd",
           "is_callable_batches", "epoch_length"]
