"""What ``watch`` and ``watch --at`` share beside their hooks (:class:`nanprobe.reach.hooks.ScriptHooks`): the
root module's forward as a Target, and GradScaler's unscale done before its step."""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..base.precision import Precision
from ..reach.forward import ForwardStep
from ..reach.target import Target, validate


def forward_target(model: torch.nn.Module, opt: torch.optim.Optimizer | None, autocast: str | None, device: str,
                   who: str, schedulers: Any = (), **more: Any) -> tuple[Target, Precision]:
    """The root module's forward as the Target the diagnosis reruns (its optimizer and schedulers when the
    optimizer updates only the module's own parameters), and the precision of its autocast dtype."""
    own = {id(q) for q in model.parameters()}
    use_opt = opt is not None and all(id(q) in own for g in opt.param_groups for q in g["params"])
    scheds = [s for s in list(schedulers) if use_opt and getattr(s, "optimizer", None) is opt]
    precision = {"bfloat16": Precision.BF16, "float16": Precision.FP16}.get(autocast, Precision.FP32)
    return validate({"model": model, "step_fn": ForwardStep(device), "batches": [],
                     "optimizer": opt if use_opt else None, "scheduler": scheds or None, "precision": precision,
                     **more}, who), precision


def unscale_ready(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """What ``GradScaler.step`` does first, done before it: the check sees unscaled gradients."""
    if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


__all__ = ["unscale_ready", "forward_target"]
