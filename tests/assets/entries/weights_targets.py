"""Tiny targets whose weights are stored in low precision (pure bf16 training: ``model.to(torch.bfloat16)``,
no autocast) for tests/locate/test_weights_precision.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def _batches(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, 6, generator=g), "y": torch.randint(0, 3, (8,), generator=g)} for _ in range(n)]


def _ce(model, batch):
    x = batch["x"].to(torch.bfloat16)   # the user casts to the weights' dtype by name
    return F.cross_entropy(model(x).float(), batch["y"])


def pure_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3)).to(torch.bfloat16)
    return {"model": model, "loss_fn": _ce, "batches": _batches(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}
