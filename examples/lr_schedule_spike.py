"""LR spike: a warmup lambda that returns the step instead of step / warmup.

``LambdaLR`` multiplies the base LR by what the lambda returns. The intended warmup is
``min(1, step / warmup)``; the bug ``min(step, warmup)`` ramps the multiplier to 1, 2, 3 ... 200.
The data is clean and every op is fine; the updates |dw|/|w| explode and a few steps later the
loss jumps by orders of magnitude and then overflows.

Expected diagnosis: lr_spike, update.
"""

import torch
import torch.nn.functional as F
from torch import nn

WARMUP = 200


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        return self.out(self.hidden(x))


def make_batches(steps: int = 40):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        out.append((x, x @ w))
    return out


def target():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(step + 1, WARMUP))  # bug: not / WARMUP
    return {"model": model, "loss_fn": lambda m, b: F.mse_loss(m(b[0]), b[1]), "batches": make_batches(),
            "optimizer": optimizer, "scheduler": scheduler}
