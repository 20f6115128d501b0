"""A finite loss spike from one batch, under plain SGD: the update it causes is not its cause.

A vibration model reads accelerometer features in g. One logger (batch 18
here) was misconfigured and reports in mg: its inputs are 1000x too large, the
prediction error and the loss of that batch are about 2.5e4x the usual. With
plain SGD and no clipping, that batch's own gradient is huge, so the update of
step 18 itself has |dw|/|w| far above 1. But the learning rate is constant and
every update before step 18 moved the weights by a few 1e-3 of their norm:
the step size did not cause the spike; the spike causes the big update.

Expected diagnosis: cause ``data`` (phase input), step 18 - not ``lr_spike``
because of the update the bad batch itself produced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS, GLITCH = 8, 32, 30, 18


class VibrationModel(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g)
    batches = []
    for i in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        y = torch.sin(x @ w) + 0.05 * torch.randn(BATCH_SIZE, generator=g)
        batches.append((x * 1000 if i == GLITCH else x, y))      # BUG: this logger reports mg
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = VibrationModel()
    return {"model": model, "loss_fn": mse, "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.02), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
