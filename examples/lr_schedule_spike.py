"""LR spike: a warmup multiplier that forgot to divide by the number of warmup steps.

``LambdaLR`` multiplies the base learning rate by whatever the lambda returns.
The intended schedule is a linear warmup to 1.0 over ``WARMUP_STEPS`` steps,
then constant; the lambda below returns ``step + 1`` during warmup instead of
``(step + 1) / WARMUP_STEPS``, so the learning rate is 1x, 2x, 3x, ... the
base rate, on its way to 500x. The data is clean (standardised features, a
smooth target) and every op is well-defined; SGD with momentum simply takes
steps that are too large: the LR used at step k is 0.2 * (k + 1). The loss is
fine up to step 4 (0.23), then 7.4, 37, 4.9e4, 1.7e14, and at step 9 the
squared error overflows fp32: the loss is inf and the update of that step
turns the weights into inf/NaN.

The relative update |dw| / |w| of every layer grows with the LR. At step 8
(the last finite step) it is largest for ``out`` (the output layer, ~2e9),
then ``body.2`` (~2e8) and ``body.0`` (~3e6); at step 4 it was below 1 for
every layer.

Expected diagnosis: cause ``lr_spike``, phase ``update``, first non-finite
loss at step 9 (born in ``mse_loss`` of an already diverged model), largest
relative update at step 8 in ``out``; the data is clean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 8, 32, 20
BASE_LR = 0.2
WARMUP_STEPS = 500


def warmup(step: int) -> float:
    """LR multiplier: linear warmup, then constant."""
    if step < WARMUP_STEPS:
        return step + 1  # BUG: should be (step + 1) / WARMUP_STEPS
    return 1.0


class MLP(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x)).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g) / N_FEATURES ** 0.5
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        y = torch.sin(x @ w) + 0.05 * torch.randn(BATCH_SIZE, generator=g)
        batches.append((x, y))
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    return {
        "model": model,
        "loss_fn": mse,
        "batches": make_batches(),
        "optimizer": optimizer,
        "scheduler": scheduler,
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
