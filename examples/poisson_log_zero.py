"""log(0): a Poisson rate from ReLU is exactly 0 for a sample that has events.

A count-regression model predicts event rates with ``relu(linear(h))`` and computes the Poisson
negative log-likelihood by hand in its ``head`` module: ``rate - y * log(rate)``. When the ReLU
clamps a rate to exactly 0 for a sample whose count y is positive, log(0) = -inf and the loss
becomes +inf (fp32; no precision issue involved).

Expected diagnosis: log, forward, module ``head``.
"""

import torch
from torch import nn


class PoissonNLL(nn.Module):
    def forward(self, rate, y):
        return (rate - y * torch.log(rate)).mean()


class CountModel(nn.Module):
    def __init__(self, features: int = 6):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 16), nn.Tanh())
        self.rate = nn.Linear(16, 1)
        self.head = PoissonNLL()

    def forward(self, x, y):
        rate = torch.relu(self.rate(self.body(x))).squeeze(-1)
        return self.head(rate, y)


def make_batches(steps: int = 6):
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = torch.randn(16, 6, generator=g)
        y = torch.poisson(torch.full((16,), 2.0), generator=g)
        out.append((x, y))
    return out


def target():
    torch.manual_seed(0)
    model = CountModel()
    with torch.no_grad():  # a rate head initialised around 0: ReLU clamps about half the samples
        model.rate.bias.fill_(-0.05)
    return {"model": model, "loss_fn": lambda m, b: m(b[0], b[1]), "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3)}
