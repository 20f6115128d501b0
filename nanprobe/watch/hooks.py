"""What ``watch`` and ``watch --at`` share beside their hooks (:class:`nanprobe.reach.hooks.ScriptHooks`): the
root module's forward as a Target."""

from __future__ import annotations

from typing import Any

import torch

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


__all__ = ["forward_target"]
