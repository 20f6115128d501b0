"""log(0) in a hand-written Poisson loss: ReLU makes a predicted rate exactly 0.

A model predicts daily order counts per store. Its ``head`` turns the hidden
features into a Poisson rate with ``relu(linear(h))`` (ReLU as the "rates must
be non-negative" constraint) and computes the negative log-likelihood by hand,
``rate - y * log(rate)``. ReLU is not a positivity constraint, it is a
non-negativity one: for any sample whose pre-activation is negative the rate is
exactly 0, and log(0) = -inf. With the default initialisation most stores of
the very first batch get a rate of exactly 0: for those with orders (y > 0)
``-y * log(0)`` is +inf, for those without it is 0 * inf = NaN, so the loss is
NaN at step 0. The gradients stay finite (ReLU's backward zeroes the inf/NaN
that ``LogBackward0`` produces for those samples), so only the loss shows it.
Everything is fp32; no precision is involved. ``softplus`` / ``exp`` for the rate, or
``F.poisson_nll_loss(log_rate, y, log_input=True)``, avoid it.

Expected diagnosis: cause ``log``, phase ``forward``, module ``head``
(``aten.log`` on a 0 produced by ReLU), step 0.
"""

from __future__ import annotations

import torch
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 6, 16, 20


class PoissonHead(nn.Module):
    """Rate = relu(linear(h)); returns the mean Poisson negative log-likelihood (up to log y!)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.rate = nn.Linear(hidden, 1)

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rate = torch.relu(self.rate(h)).squeeze(-1)
        return (rate - y * torch.log(rate)).mean()


class OrderCountModel(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(n_features, hidden), nn.Tanh())
        self.head = PoissonHead(hidden)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x), y)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(store features, order counts) tuples; counts ~ Poisson(exp(x . w))."""
    g = torch.Generator().manual_seed(seed)
    w = 0.3 * torch.randn(N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        y = torch.poisson(torch.exp(1.0 + x @ w), generator=g)
        batches.append((x, y))
    return batches


def poisson_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return model(x, y)


def target():
    torch.manual_seed(0)
    model = OrderCountModel()
    return {
        "model": model,
        "loss_fn": poisson_loss,
        "batches": make_batches(),
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
