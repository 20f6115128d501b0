"""A GradScaler skip storm that is not about the scale: a NaN gradient every step.

An fp16 metric-learning model pulls each anchor towards its positive with the
Euclidean distance ``((a - p) ** 2).sum(-1).sqrt()``. The pair sampler draws
positives from the same class without excluding the anchor itself, so every
batch contains at least one pair with a == p: distance 0, and the gradient of
sqrt at 0 is 1 / (2 sqrt(0)) = inf, times 0 = NaN. The loss is finite. Under
GradScaler a NaN gradient looks like an overflow: the scaler skips the update
and halves the scale - every step, because no scale makes a NaN finite. The
scale goes 65536, 32768, ..., 1, 0.5 and nothing is ever trained.

Expected diagnosis: the skip storm at step 17 (the first skip at a scale
below 1), cause ``sqrt``, phase ``backward``, module ``distance``: the NaN
is born in ``SqrtBackward0``, not in an overflowing product.
"""

from __future__ import annotations

import torch
from torch import nn

N_FEATURES, N_CLASSES, BATCH_SIZE, N_STEPS = 16, 4, 16, 24


class Distance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b) ** 2).sum(-1).sqrt()


class Embedder(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, dim: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, 32), nn.ReLU(), nn.Linear(32, dim))
        self.distance = Distance()

    def forward(self, anchor: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        return self.distance(self.net(anchor), self.net(positive))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(N_CLASSES, N_FEATURES, generator=g)
    pool_y = torch.randint(0, N_CLASSES, (BATCH_SIZE * 4,), generator=g)
    pool_x = centers[pool_y] + 0.3 * torch.randn(BATCH_SIZE * 4, N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        idx = torch.randperm(len(pool_y), generator=g)[:BATCH_SIZE]
        pos = []
        for i in idx.tolist():
            same = (pool_y == pool_y[i]).nonzero().flatten()     # BUG: includes i itself
            pos.append(int(same[torch.randint(0, len(same), (1,), generator=g)]))
        pos[0] = int(idx[0])                                      # (and the first pair always does)
        batches.append({"anchor": pool_x[idx], "positive": pool_x[torch.tensor(pos)]})
    return batches


def pull_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["anchor"], batch["positive"]).float().mean()


def target():
    torch.manual_seed(0)
    model = Embedder()
    return {"model": model, "loss_fn": pull_loss, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp16", "grad_scaler": True}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
