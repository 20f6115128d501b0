"""What the Lightning and transformers callbacks share: their settings, the hook-driven guard, the step's end."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
from collections.abc import Callable
from typing import Any

import torch

from . import require
from ..live import POLICIES, HookedGuard, HookEvent, check_policy, resolve_config, skip_update
from ..reach.feed import Position


class GuardedCallback:
    """The settings of a ``NanprobeCallback`` and the :class:`~nanprobe.live.HookedGuard` it drives."""

    command = ""                  # the guard's logger: nanprobe.<command>
    who = ""                      # how its lines and errors name it
    frameworks: tuple[str, ...] = ()   # distributions whose version the report names (the first: the fallback)
    missing: tuple[str, str, str] | None = None   # the framework is not installed: require()'s arguments

    def __init__(self, dirpath: str | os.PathLike = "nanprobe-reports", policy: str = "skip", *,
                 entry: str | None = None, config: Any = None, check_every: int | None = None,
                 max_reports: int = 1):
        if self.missing is not None:
            require(*self.missing)
        check_policy(policy, POLICIES, "NanprobeCallback(policy=...)")
        self.dirpath = dirpath
        self.policy = policy
        self.entry = entry
        self.max_reports = max_reports
        self.config = resolve_config(config, "NanprobeCallback(config=...)", check_every=check_every)
        self.events: list[HookEvent] = []
        self._guard: HookedGuard | None = None
        self._step: Any = None          # the framework's step, as a nanprobe step_fn
        self._stepped = False
        self._current: tuple[int, int] | None = None   # (global_step, epoch) of the step in progress
        self._items: list[int] = []     # the framework's indices of the step's micro-batches

    def _new_guard(self, model: torch.nn.Module, build_target: Callable[[], Any],
                   curves: Callable[[int, dict[str, float]], None]) -> None:
        self._guard = HookedGuard(command=self.command, who=self.who, model=model, build_target=build_target,
                                  config=self.config, policy=self.policy, dirpath=self.dirpath, entry=self.entry,
                                  max_reports=self.max_reports, events=self.events)
        self._guard.core.curves = curves

    def _micro(self, batch: Any, step: int, epoch: int, index: int) -> None:
        """A micro-batch (``index``: the framework's count of them) of the step in progress, or of a new step
        ``step`` in ``epoch``."""
        g = self._guard
        if not g.in_step:
            self._current = (step, epoch)
            self._items = []
        self._items.append(index)
        g.micro(batch, self._current[0])

    def _reset(self) -> None:
        """A new epoch: a step whose capture never finished is dropped."""
        if self._guard is not None and not self._guard.busy:
            self._guard.core.reset()
            self._stepped = False

    def _live(self) -> HookedGuard | None:
        """The guard, while a step is being captured and nanprobe is not rerunning one."""
        g = self._guard
        return g if g is not None and not g.busy and g.in_step and self._current is not None else None

    def _check(self, opt: torch.optim.Optimizer, index: int, **kwargs: Any) -> None:
        """Judge the step (``index``: its place in the epoch) before its update; a bad one's update is skipped."""
        step, epoch = self._current
        position = Position(step=step, epoch=epoch, index=index, items=tuple(self._items))
        if self._guard.check(step, [opt], position=position, **kwargs):
            skip_update([opt], kwargs.get("scaler"))

    def _ended(self) -> HookedGuard | None:
        """The guard, when a checked step just ended (its update applied or skipped)."""
        g = self._guard
        if g is None or g.busy or not self._stepped:
            return None
        self._stepped = False
        return g

    def _conclude(self, fallback: tuple[int, int], rewind: Callable[[int], Any]) -> bool:
        """The step is over: a bad one is diagnosed, the trainer's step counter reading its step meanwhile
        (``rewind(step)``: a context manager). True when the policy stops training."""
        g = self._guard
        g.after_update()
        step, epoch = self._current or fallback
        self._current = None
        if g.pending is None:   # a good step
            return False
        with rewind(step):   # the reruns see the trainer as the step did
            event = g.conclude(extra={"global_step": step, "epoch": epoch, "framework": self._version()})
        return event is not None and event.action == "stopped"

    def _version(self) -> str:
        for dist in self.frameworks:
            try:
                return f"{dist} {md.version(dist)}"
            except md.PackageNotFoundError:  # pragma: no cover
                continue
        return self.frameworks[0]


def enabled(scaler: Any) -> torch.amp.GradScaler | None:
    """``scaler`` if it is an enabled GradScaler."""
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


def set_for(obj: Any, name: str, value: Any) -> contextlib.ExitStack:
    """``obj.name`` reads ``value`` from now until the returned context exits."""
    stack = contextlib.ExitStack()
    stack.callback(setattr, obj, name, getattr(obj, name))
    setattr(obj, name, value)
    return stack


__all__ = ["GuardedCallback", "enabled", "set_for"]
