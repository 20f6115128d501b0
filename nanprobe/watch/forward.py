"""What `nanprobe watch` reruns and reports without the script's loss_fn: the root module's forward on
the captured inputs (and its backward when the output holds the loss), the update's forensics."""

from __future__ import annotations

from typing import Any

import torch

from ..feed import MicroBatches


def find_loss(out: Any) -> torch.Tensor | None:
    """The scalar loss a forward returned: the output itself, ``.loss``, ``["loss"]``, or the one
    floating scalar (with a graph) in a tuple/list."""
    def scalar(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point() and t.requires_grad
    if scalar(out):
        return out
    loss = getattr(out, "loss", None) if not isinstance(out, (dict, tuple, list, torch.Tensor)) else None
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if scalar(loss):
        return loss
    if isinstance(out, (tuple, list)):
        found = [t for t in out if scalar(t)]
        if len(found) == 1:
            return found[0]
    return None


def batch_of(args: tuple, kwargs: dict, autocast: str | None) -> dict[str, Any]:
    return {"args": tuple(args), "kwargs": dict(kwargs), "autocast": autocast}


class ForwardStep:
    """What ``watch`` reruns without the script's loss_fn: the root module's forward on the captured
    inputs, under the autocast dtype the script used, and its backward when the output holds the loss.
    No optimizer step: the update is the script's. Its capsules say so (``form``): ``nanprobe run ENTRY
    --capsule`` reruns them this way, whatever the ENTRY's loss_fn."""

    form = "watch_forward"

    def __init__(self, device_type: str):
        self.device_type = device_type

    def __call__(self, model: torch.nn.Module, batch: Any, step: int) -> torch.Tensor | None:
        micro = batch if isinstance(batch, MicroBatches) else [batch]
        total = None
        for item in micro:
            if not isinstance(item, dict):   # a step in which the root module was not called
                continue
            dtype = item.get("autocast")
            ctx = torch.autocast(self.device_type, dtype=getattr(torch, dtype)) if dtype else \
                torch.autocast(self.device_type, enabled=False)
            with torch.enable_grad():
                with ctx:
                    out = model(*item["args"], **item["kwargs"])
                loss = find_loss(out)
                if loss is not None:
                    loss.backward()
            if loss is not None:
                d = loss.detach().float()
                total = d if total is None else total + d
        return total


def device_of_module(module: torch.nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


def autocast_dtype(module: torch.nn.Module) -> str | None:
    device = device_of_module(module)
    if torch.is_autocast_enabled(device):
        return str(torch.get_autocast_dtype(device)).replace("torch.", "")
    return None


def params_module(opt: torch.optim.Optimizer) -> torch.nn.Module:
    """A module holding the optimizer's parameters (no root module was found)."""
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList([p for g in opt.param_groups for p in g["params"]])
    return holder


__all__ = ["ForwardStep", "find_loss", "batch_of", "device_of_module", "autocast_dtype", "params_module"]
