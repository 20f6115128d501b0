"""What `nanprobe watch` reruns and reports without the script's loss_fn: the root module's forward on
the captured inputs (and its backward when the output holds the loss), the update's forensics."""

from __future__ import annotations

from typing import Any

import torch

from .feed import MicroBatches
from ..base.report import Cause, Finding, Origin, Phase


def find_loss(out: Any) -> torch.Tensor | None:
    """The scalar loss a forward returned: the output itself, ``.loss``, ``["loss"]``, or the one
    floating scalar (with a graph) in a tuple/list."""
    def scalar(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point() and t.requires_grad
    if scalar(out):
        return out
    loss = out.get("loss") if isinstance(out, dict) else \
        None if isinstance(out, (tuple, list, torch.Tensor)) else getattr(out, "loss", None)
    if scalar(loss):
        return loss
    found = [t for t in out if scalar(t)] if isinstance(out, (tuple, list)) else []
    return found[0] if len(found) == 1 else None


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
            ctx = torch.autocast(self.device_type, dtype=getattr(torch, dtype) if dtype else None, enabled=bool(dtype))
            with torch.enable_grad():
                with ctx:
                    out = model(*item["args"], **item["kwargs"])
                loss = find_loss(out)
                if loss is not None:
                    loss.backward()
                    total = loss.detach().float() if total is None else total + loss.detach().float()
        return total


_RISKY = {"log": Cause.LOG, "log1p": Cause.LOG, "log2": Cause.LOG, "log10": Cause.LOG, "xlogy": Cause.LOG,
          "div": Cause.DIV, "reciprocal": Cause.DIV, "rsqrt": Cause.DIV, "sqrt": Cause.SQRT,
          "acos": Cause.DOMAIN, "asin": Cause.DOMAIN, "atanh": Cause.DOMAIN, "exp": Cause.OVERFLOW,
          # the unbiased std / var of one value divides by n - 1 = 0: NaN from a finite input
          "std": Cause.DIV, "var": Cause.DIV, "stdmean": Cause.DIV, "varmean": Cause.DIV}


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors a forward returned (tensor, tuple/list, dict or ModelOutput), by reference."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        return [t for v in out.values() for t in output_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in output_tensors(v)]
    return []


def ops_between(loss_nodes: list[Any], stop: set[int], limit: int = 400) -> list[str]:
    """The autograd nodes from the backpropagated losses back to the root module's outputs (``stop``:
    their grad_fn ids), nearest the loss first: the ops the script ran outside the model. The nodes
    outlive backward (their saved tensors do not), so this costs nothing until a step goes bad."""
    seen: set[int] = set()
    names: list[str] = []
    queue = [n for n in loss_nodes if n is not None]
    while queue and len(seen) < limit:
        node = queue.pop(0)
        if id(node) in seen or id(node) in stop or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(id(node))
        names.append(node.name())
        queue.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return names


def loss_outside_finding(info: dict[str, Any], precision: str) -> tuple[Finding, Origin] | None:
    """The root module's forward, rerun on the step's inputs, is finite and the loss the script computed
    outside it is not: the origin is among the ops in between (named from the graph's structure)."""
    ops = info.get("ops") or []
    # "LogBackward0" -> "log"
    risky = list(dict.fromkeys(base for base in (n.split("Backward")[0].lower() for n in ops) if base in _RISKY))
    if not risky:
        return None
    one = len(risky) == 1
    op, cause = (f"aten.{risky[0]}", _RISKY[risky[0]]) if one else (None, Cause.UNKNOWN)
    lines = [f"the root module's forward, rerun on the step's inputs under instrumentation, is finite and the loss "
             f"the script computed from its outputs is {info['loss']}: the first non-finite value was born in the "
             "script's loss, outside the model",
             f"the only op among them that makes a non-finite value from finite inputs: {risky[0]}" if one else
             f"ops among them that can make a non-finite value from finite inputs: {', '.join(risky)}",
             "ops between the model's outputs and the loss (autograd graph, nearest the loss first): "
             + ", ".join(ops[:12]) + (" ..." if len(ops) > 12 else ""),
             "read from the graph's structure (backward freed its values): for the op's inputs, source line and "
             "samples, replay the capsule with an ENTRY whose loss_fn computes this loss"]
    module = "(loss outside the model)"
    if info.get("kind") == "nan" and set(risky) <= {"exp"}:   # exp makes +inf, never NaN, from a finite input
        op, cause = None, Cause.UNKNOWN
        lines.insert(2, "but the loss is NaN, which exp does not make from a finite input: the NaN may come from a "
                        "value computed without gradients (advantages, targets, a normalisation) that the graph "
                        "does not show")
    return (Finding(cause=cause, confidence=0.6 if one else 0.4, phase=Phase.FORWARD, module=module, op=op,
                    evidence=tuple(lines)),
            Origin(phase=Phase.FORWARD, module=module, op=op, precision=precision, kind=info.get("kind")))


def device_of_module(module: torch.nn.Module) -> str:
    return next((p.device.type for p in module.parameters()), "cpu")


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


__all__ = ["ForwardStep", "find_loss", "batch_of", "device_of_module", "autocast_dtype", "params_module",
           "output_tensors", "ops_between", "loss_outside_finding"]
