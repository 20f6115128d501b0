"""An empty set: a supervised contrastive loss for an anchor with no positive.

A supervised contrastive (SupCon-style) loss scores each anchor by
``logsumexp`` over its positives (the other samples with the same label)
minus ``logsumexp`` over all other samples. Positives are selected by masking
every other entry of the similarity row with ``-inf`` - an intended mask. But
the sampler draws batches of 24 at random from 6 classes, and at step 2 one class
appears only once: that anchor has no positive, its row is entirely ``-inf``,
and ``logsumexp`` of nothing is log(0) = -inf. The loss is inf, the gradient
NaN. No value overflowed and no mask is wrong in itself; the set is empty.

Expected diagnosis: cause ``data`` (an anchor without positives), phase
``forward``, module ``(loss_fn)``, step 2 - not an intended mask passing
through, and not an "overflow".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, N_CLASSES, BATCH_SIZE, N_STEPS, TEMPERATURE = 12, 6, 24, 6, 0.1


class Encoder(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, dim: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, 32), nn.ReLU(), nn.Linear(32, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


def make_batches(seed: int = 10) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(N_CLASSES, N_FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        y = torch.randint(0, N_CLASSES, (BATCH_SIZE,), generator=g)   # random classes: a singleton happens
        batches.append({"x": centers[y] + 0.5 * torch.randn(BATCH_SIZE, N_FEATURES, generator=g), "label": y})
    return batches


def supcon(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    z = model(batch["x"])
    y = batch["label"]
    sim = z @ z.T / TEMPERATURE
    self_mask = torch.eye(len(y), dtype=torch.bool)
    positive = (y[:, None] == y[None, :]) & ~self_mask
    log_pos = torch.logsumexp(sim.masked_fill(~positive, float("-inf")), dim=1)
    log_all = torch.logsumexp(sim.masked_fill(self_mask, float("-inf")), dim=1)
    return (log_all - log_pos).mean()


def target():
    torch.manual_seed(0)
    model = Encoder()
    return {"model": model, "loss_fn": supcon, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
