"""What the hook-driven guard reports and the small pieces its users share: events, policies,
skipping an update from a hook, the configuration, gradient norms."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..base.errors import EXIT_FOUND, NanprobeError, UsageError
from ..base.errors import short_path as shown   # a path as the user reads it
from .core import current_lr, resolve_config, total_norm
from .guard import GuardTripped

POLICIES = ("skip", "raise", "stop", "record")


class Stopped(GuardTripped):
    """Raised into the framework's loop under policy ``raise``, after too many bad steps in a row, or
    when the weights were already non-finite before the step (skipping cannot recover them)."""

    exit_code = EXIT_FOUND

    def __init__(self, event: HookEvent, why: str):
        self.event = event
        see = [f"See the report {event.report}"] if event.report else []
        see += [f"Replay: {event.command}"] if event.command else []
        NanprobeError.__init__(self, f"nanprobe stopped training at step {event.step}: {event.reason}", why,
                               ". ".join(see) or None)


@dataclass(frozen=True, slots=True, kw_only=True)
class HookEvent:
    """One bad step caught through hooks, diagnosed in-process."""

    step: int
    status: str               # "nonfinite" | "spike" | "diverging"
    reason: str               # "loss is nan", "gradient-norm spike: ...", "another rank ..."
    action: str               # "skipped" | "recorded" (update applied) | "stopped" | "raised" | "reported" | "seen"
    local: bool               # this rank saw it itself (False: another rank did)
    headline: str             # one line: where the first non-finite value was born and why
    capsule: str | None       # the capsule written for this step
    report: str | None        # the JSON report written for this step
    command: str | None       # `nanprobe run ENTRY --capsule ...`
    rank: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    diagnosis_error: str | None = None   # the in-process diagnosis failed (a bug: the report is missing)
    why: str | None = None               # action "raised": why training cannot go on
    skipped: bool = True                 # False: an update written by hand, which nothing can skip

    def line(self, who: str) -> str:
        """The one line logged when the event happens."""
        verb = {"skipped": "update skipped", "recorded": "update applied (policy record)",
                "stopped": "update skipped, stopping training", "raised": "update skipped, raising",
                "reported": "a slow divergence, reported; training goes on",
                "seen": "no skip possible: the update is written by hand (no torch.optim optimizer)"}[self.action]
        if not self.skipped and self.action == "raised":
            verb = "raising (the update is written by hand: nothing was skipped)"
        rank = f"rank {self.rank}: " if self.rank else ""
        text = f"{who}: {rank}{self.headline}; {verb}."
        if self.report:
            text += f" Report: {shown(self.report)}."
        elif self.diagnosis_error:
            text += f" Diagnosis failed ({self.diagnosis_error})."
        if self.command:
            text += f" Replay: {self.command}"
        return text


def check_policy(policy: str, allowed: tuple[str, ...], where: str) -> str:
    if policy not in allowed:
        raise UsageError(f"unknown policy {policy!r}", where, f"Use one of: {', '.join(allowed)}")
    return policy


def skip_update(optimizers: Iterable[torch.optim.Optimizer], scaler: torch.amp.GradScaler | None = None) -> None:
    """Make the coming ``optimizer.step()`` of each optimizer change nothing (weights and optimizer state):
    its gradients are set to None for the step (torch's optimizers skip parameters without a gradient) and
    put back once it returns, so the script sees the gradients it would after a step it skipped itself
    (``p.grad.norm()`` after ``optimizer.step()`` keeps working).

    Where a GradScaler has not unscaled an optimizer's gradients yet, its ``step()`` must still find
    them (it records its inf checks there): they are dropped inside ``optimizer.step()`` instead, by a
    one-shot pre-hook, which runs only when the scaler lets the step through.
    """
    for opt in optimizers:
        if scaler is not None and scaler.is_enabled() and not unscaled(scaler, opt):
            _once(opt.register_step_pre_hook, partial(_drop_grads, opt))
        else:
            _drop_grads(opt)


def unscaled(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> bool:
    """``scaler`` has unscaled the gradients of ``opt`` in this step (``unscale_`` or its ``step``)."""
    stage = (getattr(scaler, "_per_optimizer_states", {}).get(id(opt)) or {}).get("stage")
    return getattr(stage, "name", "READY") == "UNSCALED"


def _drop_grads(opt: torch.optim.Optimizer) -> None:
    """Gradients off for the coming step, back on after it."""
    held = [(p, p.grad) for group in opt.param_groups for p in group["params"] if p.grad is not None]
    for p, _ in held:
        p.grad = None

    def put_back() -> None:
        for p, g in held:
            if p.grad is None:
                p.grad = g

    if held:
        _once(opt.register_step_post_hook, put_back)


def _once(register: Callable[[Callable[..., None]], Any], fn: Callable[[], None]) -> None:
    """``fn()`` at the optimizer's next step, once (``register``: its step pre- or post-hook registration)."""
    def hook(*args: Any) -> None:
        fn()
        handle.remove()

    handle = register(hook)


__all__ = ["HookEvent", "Stopped", "POLICIES", "check_policy", "resolve_config", "skip_update", "unscaled",
           "total_norm", "current_lr", "shown"]
