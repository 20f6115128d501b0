"""Sharded tensors (FSDP2's ``fully_shard``, tensor parallel): DTensor gradients, norms and weights as
the guards and capsules read them, without importing torch.distributed.tensor where it is not in use."""

from __future__ import annotations

from typing import Any

import torch


def full_value(t: Any) -> Any:
    """A DTensor (an FSDP2 or tensor-parallel gradient, or its norm: a partial sum over the device
    mesh) as its full value, reduced over its own mesh (every rank of that mesh must call this); any
    other value as it is."""
    return t.full_tensor() if isinstance(t, torch.Tensor) and hasattr(t, "full_tensor") else t


def local_value(t: Any) -> Any:
    """This rank's shard of a DTensor (no communication); any other value as it is."""
    return t.to_local() if isinstance(t, torch.Tensor) and hasattr(t, "to_local") else t


def sharded(model: torch.nn.Module) -> bool:
    """The model's parameters are DTensors (FSDP2's ``fully_shard``, tensor parallel): its forward
    communicates across ranks, so no rank can rerun a step of it alone."""
    return any(hasattr(p, "to_local") for p in model.parameters())


def weights_finite(model: torch.nn.Module) -> bool:
    """Every weight is finite (one sync). Sharded weights: each rank checks its shard and the flag is
    all-reduced, so every rank gets the same answer (call it on every rank)."""
    shards = [local_value(p.detach()) for p in model.parameters()]
    ok = torch.stack([torch.isfinite(p).all() for p in shards]).all() if shards else torch.tensor(True)
    if sharded(model):
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            flag = ok.float().reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item() > 0)
    return bool(ok)


__all__ = ["full_value", "local_value", "sharded", "weights_finite"]
