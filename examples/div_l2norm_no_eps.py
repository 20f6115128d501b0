"""Division by zero: L2-normalizing embeddings without eps, and a ReLU row that is all zero.

A retrieval model embeds TF-IDF vectors with a bias-free Linear + ReLU and L2-normalizes them by
hand, ``x / x.norm(dim=-1, keepdim=True)``. An empty document (all-zero TF-IDF vector) arrives at
step 3, sample 7: its embedding is all zero, its norm is 0, and 0/0 = NaN in the forward pass.

Expected diagnosis: div, forward, module ``normalize``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class L2Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class Retriever(nn.Module):
    def __init__(self, features: int = 8, dim: int = 16, classes: int = 4):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(features, dim, bias=False), nn.ReLU())
        self.normalize = L2Normalize()
        self.prototypes = nn.Parameter(torch.randn(classes, dim))

    def forward(self, x):
        z = self.normalize(self.proj(x))
        return 10.0 * z @ F.normalize(self.prototypes, dim=-1).T


def make_batches(steps: int = 6):
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = torch.rand(16, 8, generator=g) * (torch.rand(16, 8, generator=g) < 0.5)  # sparse TF-IDF weights
        y = torch.randint(0, 4, (16,), generator=g)
        if step == 3:
            x[7] = 0.0  # an empty document
        out.append((x, y))
    return out


def target():
    torch.manual_seed(0)
    model = Retriever()
    return {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]),
            "batches": make_batches(), "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3)}
