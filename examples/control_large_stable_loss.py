"""Healthy, but scary: a loss of 1e10 that is perfectly stable.

A rent model is trained on raw monthly rents in cents (70,000 to 130,000)
with MSE and no target scaling: the loss is about 1e10 every step and the
gradient norm about 4e5 - numbers that look like an overflow in the making but
are far from the float32 maximum (3.4e38) and do not grow. Adam normalises the
gradient, so the update is as small as in any run; the loss barely moves in
40 steps because the targets are so far from the initial outputs.

Expected diagnosis: healthy, exit 0 from ``nanprobe run`` and
``nanprobe smoke --steps 40``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 5, 32, 40


class RentModel(nn.Module):
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
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)            # standardised features
        cents = 1e5 * (1 + 0.3 * torch.tanh(x @ w)) + 2e3 * torch.randn(BATCH_SIZE, generator=g)
        batches.append((x, cents))
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = RentModel()
    return {"model": model, "loss_fn": mse, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
