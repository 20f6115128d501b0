"""Healthy, but scary: BatchNorm trained with a batch of 2.

A small network classifies machine states from 16 vibration features; the
data logger streams two windows per step, so every BatchNorm layer normalises
with the mean and variance of two samples. With two samples each normalised
feature is exactly +-1 (or 0 when the two agree), so what the network sees
depends on which other sample shares the batch: some pairs are easy (loss
0.003-0.03), a pair of the same state has its signal normalised away (loss up
to 7.5). The loss swings by 100x from step to step, and the gradient norm by
more (0.016 at step 42, 1350 at step 43: two nearly equal features divide by a
tiny batch variance). The learning rate is constant and nothing accumulates:
the next steps are back in the usual range. It is noisy, and it does not
diverge.

A 100x-the-running-median gradient rule fires at step 43. Expected diagnosis: healthy, exit 0 from ``nanprobe run``
and ``nanprobe smoke --steps 80``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE, N_STEPS, N_FEATURES, N_STATES = 2, 80, 16, 4


class StateNet(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32, n_states: int = N_STATES):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.head = nn.Linear(hidden, n_states)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(N_STATES, N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        y = torch.randint(0, N_STATES, (BATCH_SIZE,), generator=g)
        x = centers[y] + 0.5 * torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        batches.append((x, y))
    return batches


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def target():
    torch.manual_seed(0)
    model = StateNet()
    return {"model": model, "loss_fn": loss_fn, "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
