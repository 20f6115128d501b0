"""Healthy, but scary: a loss that lives near 5e-3 and jumps 10x-25x on some batches.

A small network learns the response curve of a temperature sensor (a smooth,
noise-free function of two readings). After a few dozen steps the MSE is
around 5e-3; every sixth batch is drawn near the edge of the calibrated range,
where the curve is harder, and its loss is 10x-25x the typical one (0.1 vs
0.005). In absolute terms nothing happens: the loss started at 0.3, the jumps
are by a few hundredths, and the next batch is back down.

A rule that compares the loss with 10x its running median fires on a hard
batch (step 35). Expected diagnosis: healthy, exit 0 from ``nanprobe run`` and
``nanprobe smoke --steps 60``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE, N_STEPS = 64, 60


class Calibration(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def response(x: torch.Tensor) -> torch.Tensor:
    return 0.3 * torch.sin(2.0 * x[:, 0]) * torch.cos(x[:, 1]) + 0.1 * x[:, 0] * x[:, 1]


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(N_STEPS):
        width = 3.0 if i % 6 == 5 else 1.0   # every 6th batch: readings near the edge of the range
        x = (torch.rand(BATCH_SIZE, 2, generator=g) * 2 - 1) * width
        batches.append((x, response(x)))
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = Calibration()
    return {"model": model, "loss_fn": mse, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
