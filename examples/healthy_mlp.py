"""Healthy: a small fp32 MLP classifier trains 20 clean steps.

Standardised features, a learnable target, AdamW, gradient clipping and a
little dropout (so that a faithful replay has to restore the RNG state).
Nothing is wrong: every loss, gradient and weight stays finite.

Expected diagnosis: healthy - no finding, exit code 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, N_CLASSES, BATCH_SIZE, N_STEPS = 10, 3, 16, 20


class MLP(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32, n_classes: int = N_CLASSES):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Dropout(0.1),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        batches.append({"x": x, "y": (x @ w).argmax(-1)})
    return batches


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def target():
    torch.manual_seed(0)
    model = MLP()
    return {
        "model": model,
        "loss_fn": classification_loss,
        "batches": make_batches(),
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        "max_grad_norm": 1.0,
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
