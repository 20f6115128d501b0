"""Divergence inside a noisy run: a MultiStepLR milestone that multiplies by 100.

The delivery-time regression of ``control_heavy_tailed_loss.py`` (targets
with Pareto-tailed delays: batch losses jump 10x-100x and recover all the
time) is trained with SGD + momentum and a step decay at step 30, typed as
``MultiStepLR(milestones=[30], gamma=100)`` instead of ``gamma=0.01``. From
step 30 the learning rate is 100x higher: the loss goes 2.3 -> 187 -> 1530
and stays in the tens to thousands for a dozen steps, and the (pre-clipping)
gradient norm jumps from about 2 to 239 at step 31 - 126x its running median.

Before the bug the run behaves like the control: its loss spikes recover, and
a 10x-the-median rule calls the noise at step 12 an ``lr_spike``. Expected
diagnosis: cause ``lr_spike``, phase ``update``, step 31, with the LR jump
(0.003 -> 0.3) and |dw|/|w| as evidence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 6, 32, 50


class DelayModel(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        z = torch.randn(BATCH_SIZE, generator=g)
        u = torch.rand(BATCH_SIZE, generator=g).clamp_min(1e-6)
        batches.append((x, x @ w * 0.5 + z * u.pow(-1 / 1.5) * 0.5))   # Pareto(1.5)-scaled noise
    return batches


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = DelayModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=3e-3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30], gamma=100)   # BUG: 0.01
    return {"model": model, "loss_fn": mse, "batches": make_batches(), "optimizer": optimizer,
            "scheduler": scheduler, "max_grad_norm": 5.0, "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
