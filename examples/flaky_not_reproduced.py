"""Not reproducible: a one-off glitch (a bit flip, a flaky kernel) corrupts one loss, once.

The model and data are healthy. The loss function simulates a transient hardware fault: the
fifth call ever (step 4 of the first pass) returns a non-finite loss. When nanprobe reruns step 4
from exactly the same state, batch and RNG, it is finite: the failure does not come from the
model, the data or the numerics.

Expected diagnosis: not_reproduced, step 4.
"""

import torch
import torch.nn.functional as F
from torch import nn

_calls = {"n": 0}


def glitchy_loss(model, batch):
    _calls["n"] += 1
    loss = F.cross_entropy(model(batch[0]), batch[1])
    if _calls["n"] == 5:  # simulated transient fault
        loss = loss * float("inf")
    return loss


def target():
    _calls["n"] = 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(10)]
    return {"model": model, "loss_fn": glitchy_loss, "batches": batches,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.05)}
