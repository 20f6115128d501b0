"""Healthy, but scary: a loss that goes negative and hovers around zero.

A heteroscedastic regression predicts a mean and a log-variance for each
sample and minimises the Gaussian negative log-likelihood
``0.5 * (log_var + (y - mu)^2 / exp(log_var))``. The noise on the targets has
a standard deviation of 0.5, so once the model has learned it the loss is
about 0.5 * (log 0.25 + 1) = -0.19 plus the error of the mean: it goes
negative at step 7 and then hovers around zero (between -0.19 and +0.22). Its
running median is close to 0, so a batch at +0.2 is "many times" the median
for a rule that divides by it (step 43: 0.020 vs a median of -0.0008).

Expected diagnosis: healthy, exit 0 from ``nanprobe run`` and
``nanprobe smoke --steps 50``.
"""

from __future__ import annotations

import torch
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 4, 64, 50


class MeanVariance(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.Tanh())
        self.mu = nn.Linear(hidden, 1)
        self.log_var = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mu(h).squeeze(-1), self.log_var(h).squeeze(-1)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        batches.append((x, 0.5 * torch.sin(x @ w) + 0.5 * torch.randn(BATCH_SIZE, generator=g)))
    return batches


def gaussian_nll(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    mu, log_var = model(x)
    return (0.5 * (log_var + (y - mu) ** 2 / log_var.exp())).mean()


def target():
    torch.manual_seed(0)
    model = MeanVariance()
    return {"model": model, "loss_fn": gaussian_nll, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=2e-2), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
