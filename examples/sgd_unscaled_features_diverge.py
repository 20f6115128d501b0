"""Early divergence: SGD on unscaled features, growing from the first step.

A linear-ish model predicts fuel consumption from raw sensor readings (rpm in
the thousands, temperatures in the hundreds): nobody standardised the inputs.
For gradient descent on a squared error the largest stable learning rate is
about 2 / (the largest eigenvalue of x^T x / n), which for inputs of size
2e3 is about 2e-7; the run uses 1e-6 (a value that works once the features
are standardised). Every step overshoots the minimum by more than the last:
the loss grows 50x-90x per step from step 0 (607, 2.9e4, 2.4e6, 2.2e8,
...) and stays finite until the gradient overflows at step 15. There is no
"normal" history to compare with, and the loss is never NaN early.

Expected diagnosis: cause ``lr_spike``, phase ``update``, step 1 (the loss is
47x the first loss already), with |dw|/|w| of step 0 as evidence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE, N_STEPS = 32, 20


class FuelModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).squeeze(-1)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_STEPS):
        rpm = 1500 + 1500 * torch.rand(BATCH_SIZE, generator=g)
        temp = 80 + 40 * torch.rand(BATCH_SIZE, generator=g)
        load = 100 * torch.rand(BATCH_SIZE, generator=g)
        x = torch.stack([rpm, temp, load], dim=1)                  # raw units: not standardised
        fuel = 0.004 * rpm + 0.02 * temp + 0.05 * load + torch.randn(BATCH_SIZE, generator=g)
        batches.append({"sensors": x, "fuel": fuel})
    return batches


def mse(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["sensors"]), batch["fuel"])


def target():
    torch.manual_seed(0)
    model = FuelModel()
    return {"model": model, "loss_fn": mse, "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=1e-6), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
