"""The masked-NaN trap: torch.where hides log(0) in the forward pass, not in the gradient.

A model computes a "safe" log of non-negative rates with
``torch.where(x > 0, torch.log(x), 0)``. The forward value is finite, so the loss looks fine, but
autograd differentiates both branches: d/dx log(x) at x = 0 is 1/0, multiplied by the zero
gradient the mask sends, gives NaN, and the NaN lands in the weights.

Expected diagnosis: log, forward (born in the log, masked), module ``safe_log``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class SafeLog(nn.Module):
    def forward(self, x):
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


class RateModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(5, 5)
        self.safe_log = SafeLog()
        self.head = nn.Linear(5, 1)

    def forward(self, counts):
        rates = counts * torch.sigmoid(self.scale(counts))  # zero wherever a count is zero
        return self.head(self.safe_log(rates)).squeeze(-1)


def make_batches(steps: int = 5):
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        counts = torch.poisson(torch.full((8, 5), 3.0), generator=g) + 1
        if step == 2:
            counts[4, 1] = 0.0  # a zero count: log(0) in the masked branch
        out.append((counts, torch.randn(8, generator=g)))
    return out


def target():
    torch.manual_seed(0)
    model = RateModel()
    return {"model": model, "loss_fn": lambda m, b: F.mse_loss(m(b[0]), b[1]), "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.01)}
