"""exp overflow in fp32: a hand-written softplus ``log(1 + exp(x))`` meets an outlier.

A regression model on sensor readings uses a smooth activation written out by
hand in ``encoder.act``: ``torch.log(1 + torch.exp(x))``. The readings are
standardised with statistics computed on a clean sample, so they are O(1) -
until step 3, where one reading (sample 2, channel 1) is a sensor glitch of 500.
The pre-activation of that sample exceeds 88.7, ``exp`` overflows fp32 to inf,
``log(1 + inf)`` is inf, and the next layer turns inf * weights of both signs
into NaN. ``F.softplus`` (which switches to the identity for large inputs) or
``torch.logaddexp(x, 0)`` compute the same function without overflowing.

Expected diagnosis: cause ``overflow``, phase ``forward``, module
``encoder.act`` (``aten.exp``), step 3, sample 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_CHANNELS, BATCH_SIZE, N_STEPS = 4, 8, 20


class SmoothReLU(nn.Module):
    """softplus, as written in the paper."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(1 + torch.exp(x))


class Encoder(nn.Module):
    def __init__(self, n_in: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(n_in, hidden)
        self.act = SmoothReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class SensorRegressor(nn.Module):
    def __init__(self, n_in: int = N_CHANNELS, hidden: int = 16):
        super().__init__()
        self.encoder = Encoder(n_in, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)).squeeze(-1)


def make_batches(seed: int = 0) -> list[list[torch.Tensor]]:
    """[readings, target] pairs; readings are standardised."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_CHANNELS, generator=g)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_CHANNELS, generator=g)
        y = torch.tanh(x @ w)
        if step == 3:
            x[2, 1] = 500.0  # a sensor glitch that the standardisation did not catch
        batches.append([x, y])
    return batches


def mse(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = SensorRegressor()
    return {
        "model": model,
        "loss_fn": mse,
        "batches": make_batches(),
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
