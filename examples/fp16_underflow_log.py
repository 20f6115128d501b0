"""fp16 underflow: sigmoid of a confident logit flushes to 0, and the "+ 1e-8" guard is a no-op.

A click-through-rate model computes its binary cross-entropy by hand inside its ``head`` module:
``-log(sigmoid(z) + 1e-8)``. Under fp16 autocast the logits and the sigmoid are fp16. At step 2
a batch with large feature values makes the model confident; sigmoid(z) for z around -20 is
2e-9, below fp16's smallest subnormal (6e-8), so it becomes exactly 0, and 1e-8 is itself 0 in
fp16. log(0) = -inf. In fp32 the same step is finite.

Expected diagnosis: underflow (then log), forward, module ``head``.
"""

import torch
from torch import nn


class BCEHead(nn.Module):
    """Binary cross-entropy written out by hand (the fused BCE-with-logits avoids all of this)."""

    def forward(self, z, y):
        p = torch.sigmoid(z)
        return -(y * torch.log(p + 1e-8) + (1 - y) * torch.log(1 - p + 1e-8)).mean()


class CTRModel(nn.Module):
    def __init__(self, features: int = 12):
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 1))
        self.head = BCEHead()

    def forward(self, x, y):
        return self.head(self.tower(x).squeeze(-1), y)


def make_batches(steps: int = 6):
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = torch.randn(32, 12, generator=g)
        y = (torch.rand(32, generator=g) < 0.3).float()
        if step == 2:
            x = x * 40          # un-normalized features from a new data source
            y = torch.ones(32)  # ... that are all positive clicks
        out.append({"features": x, "clicked": y})
    return out


def target():
    torch.manual_seed(0)
    model = CTRModel()
    return {"model": model, "loss_fn": lambda m, b: m(b["features"], b["clicked"]), "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.01), "precision": "fp16"}
