"""Healthy, but scary: a regression whose targets have heavy-tailed noise.

A model predicts the delivery time of parcels from a few route features. Most
deliveries are on time, but a few per batch are days late (strikes, lost
parcels): the noise on the target has a Pareto(1.5) scale (tails like a Student-t
with 1.5 degrees of freedom), so its variance is infinite and the per-batch MSE is heavy-tailed. Every few
steps one batch holds an extreme delay and its loss is 10x to 100x the typical
loss; the next batch is back to normal. The learning rate is constant, the
gradient is clipped at 1.0, and the weights move by about 1e-3 of their norm
per step: the spikes are the data's tails, not a divergence.

A 10x-the-running-median rule calls this an ``lr_spike``. Expected diagnosis:
healthy, exit 0 from ``nanprobe run`` and ``nanprobe smoke --steps 60``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 6, 32, 60


class DelayModel(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        z = torch.randn(BATCH_SIZE, generator=g)
        u = torch.rand(BATCH_SIZE, generator=g).clamp_min(1e-6)
        t = z * u.pow(-1 / 1.5) * 0.5      # a normal with a Pareto(1.5) scale: tails like Student-t(1.5)
        y = x @ w * 0.5 + t
        batches.append((x, y))
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = DelayModel()
    return {
        "model": model,
        "loss_fn": mse,
        "batches": make_batches(),
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3),
        "max_grad_norm": 1.0,
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
