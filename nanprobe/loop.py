"""The user's training step as nanprobe reproduces it, and exact snapshots of the state before it."""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .batch import iter_tensors
from .precision import Precision, autocast_context, device_of, numeric_mode, policy_context
from .report import Phase
from .target import Target, call_user, check_loss


def make_scaler(target: Target, precision: Precision, device_type: str) -> torch.amp.GradScaler | None:
    if precision is Precision.FP16 and target.grad_scaler and target.optimizer is not None:
        return torch.amp.GradScaler(device_type)
    return None


@dataclass(slots=True)
class StepOutcome:
    loss: torch.Tensor | None          # detached scalar (device)
    grad_norm: torch.Tensor | None     # detached scalar (device), unscaled
    lr: float | None
    skipped: bool = False              # GradScaler skipped the update
    scale: float | None = None


def current_lr(optimizer: torch.optim.Optimizer | None) -> float | None:
    if optimizer is None or not optimizer.param_groups:
        return None
    lr = optimizer.param_groups[0].get("lr")
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr) if lr is not None else None


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def train_step(target: Target, batch: Any, precision: Precision, scaler: torch.amp.GradScaler | None, *,
               where: str, set_phase: Callable[[Phase], None] | None = None,
               max_grad_norm: float | None = None, lr_scale: float | None = None,
               policy: str = "native") -> StepOutcome:
    """One step of the canonical loop: zero_grad, autocast forward+loss, backward, clip, step, schedule.

    ``max_grad_norm`` and ``lr_scale`` override the target's (used to verify fixes); ``policy``
    "cuda" emulates CUDA's autocast op list on CPU.
    """
    model, opt = target.model, target.optimizer
    device_type = device_of(model).type
    phase = set_phase or (lambda p: None)
    clip = max_grad_norm if max_grad_norm is not None else target.max_grad_norm
    model.train()
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    phase(Phase.FORWARD)
    with numeric_mode(precision, device_type), policy_context(policy, precision, device_type), \
            autocast_context(precision, device_type):
        loss = call_user("loss_fn(model, batch)", target.loss_fn, model, batch)
    loss = check_loss(loss, where)
    phase(Phase.BACKWARD)
    call_user("loss.backward()", (scaler.scale(loss) if scaler else loss).backward)
    phase(Phase.UPDATE)
    if scaler is not None:
        scaler.unscale_(opt)
    grads = _grads(model)
    if clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    elif grads:
        grad_norm = torch.nn.utils.get_total_norm(grads)
    else:
        grad_norm = None
    lr = current_lr(opt)
    skipped = False
    scale = None
    if opt is not None:
        saved_lr = None
        if lr_scale is not None:
            saved_lr = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * lr_scale
        try:
            if scaler is not None:
                before = scaler.get_scale()
                call_user("optimizer.step()", scaler.step, opt)
                scaler.update()
                scale = scaler.get_scale()
                skipped = scale < before  # GradScaler.step returns None either way; a skip halves the scale
            else:
                call_user("optimizer.step()", opt.step)
        finally:
            if saved_lr is not None:
                for g, v in zip(opt.param_groups, saved_lr):
                    g["lr"] = v
        if target.scheduler is not None and not skipped:
            call_user("scheduler.step()", target.scheduler.step)
    return StepOutcome(loss=loss.detach(), grad_norm=None if grad_norm is None else grad_norm.detach(),
                       lr=lr, skipped=skipped, scale=scale)


# -- snapshots ---------------------------------------------------------------------------------

def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


@dataclass(slots=True)
class Snapshot:
    """Model, optimizer, scheduler, GradScaler and RNG state at one moment, restorable exactly."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any]
    threads: int

    @classmethod
    def take(cls, target: Target, scaler: torch.amp.GradScaler | None) -> Snapshot:
        model = {k: v.detach().clone() for k, v in target.model.state_dict().items()}
        opt = copy.deepcopy(target.optimizer.state_dict()) if target.optimizer is not None else None
        sched = copy.deepcopy(target.scheduler.state_dict()) if target.scheduler is not None \
            and hasattr(target.scheduler, "state_dict") else None
        return cls(model=model, optimizer=opt, scheduler=sched,
                   scaler=scaler.state_dict() if scaler is not None else None,
                   rng=_rng_state(device_of(target.model)), threads=torch.get_num_threads())

    def restore(self, target: Target, scaler: torch.amp.GradScaler | None) -> None:
        with torch.no_grad():
            target.model.load_state_dict(self.model)
        if self.optimizer is not None:
            target.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        if self.scheduler is not None:
            target.scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        if scaler is not None and self.scaler:
            scaler.load_state_dict(self.scaler)
        torch.set_num_threads(self.threads)
        _set_rng_state(self.rng)


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the batch's first tensor: the sample axis by convention."""
    for _, t in iter_tensors(batch):
        if t.dim() >= 1:
            return int(t.shape[0])
    return None
