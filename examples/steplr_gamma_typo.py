"""LR spike under clipping: ``StepLR(gamma=10)`` where ``gamma=0.1`` was meant.

An image-feature regressor is trained with SGD + momentum, its gradient norm
clipped at 0.25 as the paper it reproduces says. The decay schedule was typed
as ``StepLR(step_size=6, gamma=10)``: instead of dividing the LR by 10 every 6
steps it multiplies it, 0.02 -> 0.2 at step 6 -> 2 at step 12 -> 20 at step 18.
Clipping keeps each gradient at norm 0.25, but the update is LR x gradient
(plus momentum): at LR 2 the parameters move by a quarter of their norm per
step (|dw|/|w| = 0.25 at step 13), the loss jumps from 0.07 to 13.5 at step
13, and at step 14 the gradient norm is 119x its running median.

Tightening the clipping (the usual advice) does nothing here: the user already
clips at 0.25. Expected diagnosis: cause ``lr_spike``, phase ``update``, step
14, with the LR rise (0.02 -> 2) as evidence and no clipping fix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 16, 32, 30


class Regressor(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x)).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g) / N_FEATURES ** 0.5
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        batches.append((x, torch.sin(x @ w) + 0.05 * torch.randn(BATCH_SIZE, generator=g)))
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=6, gamma=10)   # BUG: meant gamma=0.1
    return {"model": model, "loss_fn": mse, "batches": make_batches(), "optimizer": optimizer,
            "scheduler": scheduler, "max_grad_norm": 0.25, "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
