"""A finite loss spike that is not the learning rate: one batch in the wrong units.

A model predicts parcel weights in kilograms. The data comes from several
warehouses; one warehouse's export (batch 24 here) is in grams. Its targets
are 1000x too large, so that batch's MSE is about 1e6x the running loss.
The learning rate is constant, the gradient is clipped at 1.0 and the
weights move by about 1e-3 of their norm per step before it. Nothing diverges:
one batch is wrong.

A spike rule that blames every spike on the LR sends the user to the
schedule. Expected diagnosis: cause ``data`` (phase input), step 24, with the
evidence that the LR is constant and the updates are small.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS, GRAMS_BATCH = 6, 32, 40, 24


class WeightModel(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(N_FEATURES, generator=g)
    batches = []
    for i in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)                 # box dimensions, standardised
        kg = 2.0 + x @ w + 0.1 * torch.randn(BATCH_SIZE, generator=g)
        batches.append({"dims": x, "weight": kg * 1000 if i == GRAMS_BATCH else kg})   # BUG: grams
    return batches


def mse(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["dims"]), batch["weight"])


def target():
    torch.manual_seed(0)
    model = WeightModel()
    return {"model": model, "loss_fn": mse, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "max_grad_norm": 1.0, "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
