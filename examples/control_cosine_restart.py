"""Healthy, but scary: a cosine schedule with warm restarts.

``CosineAnnealingWarmRestarts(T_0=20)`` decays the learning rate of SGD from
0.3 to 0.002 over 20 steps, then jumps straight back to 0.3: a 140x increase
of the learning rate in one step, at steps 20 and 40. After each restart the
loss of this regression rises for a few steps (0.048 -> 0.24 at step 23,
0.037 -> 0.18 at step 44: the weights leave the minimum the small learning
rate settled into) and then comes back down. The LR jump is the schedule, not
a bug, and the loss recovers.

Expected diagnosis: healthy, exit 0 from ``nanprobe run`` and
``nanprobe smoke --steps 60``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 12, 64, 60


class Regressor(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        batches.append((x, torch.tanh(x @ w / 3)))
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=20, eta_min=3e-4)
    return {"model": model, "loss_fn": mse, "batches": make_batches(), "optimizer": optimizer,
            "scheduler": scheduler, "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
