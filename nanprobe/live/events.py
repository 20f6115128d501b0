"""What the hook-driven guard reports and the small pieces its users share: events, policies,
skipping an update from a hook, the configuration, gradient norms."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..base.errors import EXIT_FOUND, NanprobeError, UsageError
from ..base.errors import short_path as shown   # a path as the user reads it
from .core import current_lr, distributed, grads_of, resolve_config, total_norm
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


def check_policy(policy: str, allowed: Iterable[str], where: str) -> str:
    allowed = tuple(allowed)
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
        stage = (getattr(scaler, "_per_optimizer_states", {}).get(id(opt)) or {}).get("stage")
        if scaler is not None and scaler.is_enabled() and getattr(stage, "name", "READY") != "UNSCALED":
            handle = None

            def drop(o, args, kwargs, _opt=opt):
                _drop_grads(_opt)
                handle.remove()

            handle = opt.register_step_pre_hook(drop)
        else:
            _drop_grads(opt)


def _drop_grads(opt: torch.optim.Optimizer) -> None:
    """Gradients off for the coming step, back on after it (a one-shot step post-hook)."""
    held = [(p, p.grad) for group in opt.param_groups for p in group["params"] if p.grad is not None]
    for p, _ in held:
        p.grad = None
    if not held:
        return
    handle = None

    def put_back(o, args, kwargs):
        for p, g in held:
            if p.grad is None:
                p.grad = g
        handle.remove()

    handle = opt.register_step_post_hook(put_back)


__all__ = ["HookEvent", "Stopped", "POLICIES", "check_policy", "resolve_config", "distributed",
           "skip_update", "grads_of", "total_norm", "current_lr", "shown"]
