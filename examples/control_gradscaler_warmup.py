"""Healthy, but scary: GradScaler skips the first 14 steps while its scale comes down.

An fp16 model forecasts hourly energy use (kWh, in the tens to hundreds) from
raw meter readings. ``torch.amp.GradScaler`` starts at a loss scale of 65536;
the unscaled gradient norm is about 1.4e4, so scaled by 65536 it overflows
fp16 (max 65504) and the scaler skips the update and halves the scale - fourteen
times in a row, down to 4, where the scaled gradients fit. From then on
every update is applied. That is the scaler doing its job: the skipped steps
have finite losses, and the values overflow only because of the scale.

A "more than 8 skips in a row" rule calls this an ``overflow``. Expected
diagnosis: healthy, exit 0 from ``nanprobe run`` and
``nanprobe smoke --steps 40``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 8, 32, 40


class Forecaster(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = 20 + 20 * torch.rand(BATCH_SIZE, N_FEATURES, generator=g)   # raw readings, not standardised
        y = x @ w + 5 * torch.randn(BATCH_SIZE, generator=g)
        batches.append((x, y))
    return batches


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def target():
    torch.manual_seed(0)
    model = Forecaster()
    return {"model": model, "loss_fn": loss_fn, "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=1e-5),
            "precision": "fp16", "grad_scaler": True}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
