"""Unclipped gradient explosion: an exp output trained with MSE and plain SGD.

A demand model predicts daily sales counts as ``rate = exp(f(x))`` (to keep
them positive) but is trained with a squared error on the counts instead of a
Poisson likelihood. The gradient of (exp(f) - y)^2 is 2 (exp(f) - y) exp(f):
it grows like exp(2f). Each overshoot of exp(f) makes the next gradient
larger, and with no gradient clipping the updates feed on each other: the
gradient norm goes from about 150 to 1070 over steps 4-6, |dw|/|w| reaches
0.46 at step 6, the loss jumps from 860 to 7.4e4 at step 7 and is inf at
step 8.

Expected diagnosis: cause ``lr_spike`` (an unclipped gradient explosion),
phase ``update``, step 7 (the loss is 40x the first losses), with "clip the
global gradient norm" among the fixes.
"""

from __future__ import annotations

import torch
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 5, 32, 30


class DemandModel(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 16):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(n_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.f(x).squeeze(-1))      # the predicted rate


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        counts = torch.poisson(torch.exp(3.5 + 0.3 * (x @ w)), generator=g)
        batches.append((x, counts))
    return batches


def squared_error(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, counts = batch
    return ((model(x) - counts) ** 2).mean()


def target():
    torch.manual_seed(0)
    model = DemandModel()
    return {"model": model, "loss_fn": squared_error, "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
