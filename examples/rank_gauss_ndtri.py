"""An op no rule knows: ``ndtri`` (the inverse normal CDF) at exactly 1.0.

A tabular model "rank-gauss" normalises each feature inside its forward pass:
the rank of each value among the batch, scaled to (0, 1], then mapped
through the inverse normal CDF ``torch.special.ndtri`` to a standard normal
variable. The scaling is ``rank / n`` instead of ``(rank + 0.5) / n``, so the
largest value of each column gets exactly 1.0, and ndtri(1.0) = +inf: the
quantile of probability 1. The input is finite and small; nothing overflowed.

nanprobe has no rule for ``special_ndtri``. Expected diagnosis: an honest
low-confidence "unknown origin" finding - cause ``domain`` (an input at the
edge of where the op is finite), phase ``forward``, module ``rankgauss`` -
never "exceeds the float32 maximum".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 6, 32, 6


class RankGauss(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        ranks = x.argsort(0).argsort(0).float() + 1          # 1..n per column
        return torch.special.ndtri(ranks / n)                # BUG: (ranks - 0.5) / n keeps it inside (0, 1)


class TabularNet(nn.Module):
    def __init__(self, n_features: int = N_FEATURES):
        super().__init__()
        self.rankgauss = RankGauss()
        self.mlp = nn.Sequential(nn.Linear(n_features, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.rankgauss(x)).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g).exp()   # skewed raw features
        batches.append((x, torch.log1p(x) @ w))
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = TabularNet()
    return {"model": model, "loss_fn": mse, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
