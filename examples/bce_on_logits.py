"""A raise that is a domain error: ``binary_cross_entropy`` on logits.

A multi-label tagger's head was changed from ``sigmoid(linear(x))`` to
``linear(x)`` when the team switched the loss to ``BCEWithLogitsLoss`` - but
one training script still calls ``F.binary_cross_entropy``. BCE checks its
input and raises at the first step, ``RuntimeError: all elements of input
should be between 0 and 1``, because logits are negative about half the time.
No NaN exists; before, nanprobe called this a bug in the code (exit 2).

Expected diagnosis: cause ``domain`` (BCE input outside [0, 1]), phase
``forward``, module ``(loss_fn)``, step 0, with the input's range as evidence
and ``binary_cross_entropy_with_logits`` as the fix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, N_TAGS, BATCH_SIZE, N_STEPS = 12, 5, 16, 6


class Tagger(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, n_tags: int = N_TAGS):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, 32), nn.ReLU(), nn.Linear(32, n_tags))   # logits now

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, N_TAGS, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        batches.append((x, (x @ w > 0).float()))
    return batches


def tag_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, tags = batch
    return F.binary_cross_entropy(model(x), tags)      # BUG: the model returns logits now


def target():
    torch.manual_seed(0)
    model = Tagger()
    return {"model": model, "loss_fn": tag_loss, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
