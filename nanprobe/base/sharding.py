"""Sharded tensors (FSDP2's ``fully_shard``, tensor parallel, FSDP1's flat parameters): gradients, norms
and weights as the guards and capsules read them, without importing torch.distributed.tensor where it
is not in use."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

_FSDP1: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fsdp1_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost FSDP1 ``FullyShardedDataParallel`` of ``model`` (itself, or inside a wrapper), or None
    (looked up once per model)."""
    try:
        ref = _FSDP1[model]
        return ref() if ref is not None else None
    except KeyError:
        pass
    except TypeError:   # not weak-referenceable
        return None
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)  # never imported
    root = next((m for m in model.modules() if isinstance(m, fsdp)), None) if fsdp is not None else None
    _FSDP1[model] = weakref.ref(root) if root is not None else None   # (root may be the model: a weak value)
    return root


def total_norm(model: torch.nn.Module, grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The global 2-norm of ``grads`` as ``clip_grad_norm_`` of this model computes it. FSDP1: each rank
    holds a shard of every gradient, so the local norms are combined over FSDP's process group (the sum
    of squares, as ``FullyShardedDataParallel.clip_grad_norm_`` does; every rank must call this, also one
    without a gradient). Otherwise the local norm (a DTensor's: partial, see :func:`full_value`)."""
    root = fsdp1_root(model)
    if root is None:
        return torch.nn.utils.get_total_norm(grads) if grads else None
    local = torch.nn.utils.get_total_norm(grads).float() if grads else \
        torch.zeros((), device=root.compute_device if hasattr(root, "compute_device") else "cpu")
    sq = (local * local).reshape(1)
    torch.distributed.all_reduce(sq, group=root.process_group)
    return sq[0].sqrt()


def clip_norm(model: torch.nn.Module, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` as the user's own loop calls it for this model: FSDP1's own method (the norm
    of the whole, sharded gradient), else ``torch.nn.utils.clip_grad_norm_`` of ``params``."""
    root = fsdp1_root(model)
    return root.clip_grad_norm_(max_norm) if root is not None else torch.nn.utils.clip_grad_norm_(params, max_norm)


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


def collective_device() -> torch.device:
    """Where the default group's collectives take tensors (NCCL: this rank's GPU)."""
    nccl = torch.distributed.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def weights_finite(model: torch.nn.Module) -> bool:
    """Every weight is finite (one sync). Under torch.distributed each rank checks its own weights (its
    shard, when sharded) and the flag is all-reduced, so every rank gets the same answer and takes the
    same path after it (a capsule is written by every rank or none): call it on every rank."""
    shards = [local_value(p.detach()) for p in model.parameters()]
    ok = torch.stack([torch.isfinite(p).all() for p in shards]).all() if shards else torch.tensor(True)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = ok.float().reshape(1).to(collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() > 0)
    return bool(ok)


__all__ = ["full_value", "local_value", "sharded", "weights_finite", "fsdp1_root", "total_norm", "clip_norm",
           "collective_device"]
