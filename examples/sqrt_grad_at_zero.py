"""sqrt's gradient at 0: a hand-written Euclidean distance meets a pair of identical inputs.

A siamese network learns embeddings with a contrastive loss on the distance
``sqrt(sum((a - b) ** 2))``. When a batch contains a positive pair of two identical items (a
duplicate in the dataset), the distance is exactly 0. The forward pass is fine, but
d/dx sqrt(x) = 1 / (2 sqrt(x)) is infinite at 0 and the chain rule turns it into NaN gradients.

Expected diagnosis: sqrt, backward, module ``distance`` (autograd node SqrtBackward0).
"""

import torch
import torch.nn.functional as F
from torch import nn


class EuclideanDistance(nn.Module):
    def forward(self, a, b):
        return torch.sqrt(((a - b) ** 2).sum(-1))


class Siamese(nn.Module):
    def __init__(self, features: int = 10, dim: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, dim))
        self.distance = EuclideanDistance()

    def forward(self, a, b):
        return self.distance(self.encoder(a), self.encoder(b))


def contrastive(model, batch, margin: float = 1.0):
    a, b, same = batch
    d = model(a, b)
    return (same * d.pow(2) + (1 - same) * F.relu(margin - d).pow(2)).mean()


def make_pairs(steps: int = 6, n: int = 12):
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        a = torch.randn(n, 10, generator=g)
        b = torch.randn(n, 10, generator=g)
        same = (torch.rand(n, generator=g) < 0.5).float()
        if step == 4:
            b[3] = a[3]       # a duplicated item forms a positive pair with itself
            same[3] = 1.0
        out.append((a, b, same))
    return out


def target():
    torch.manual_seed(0)
    model = Siamese()
    return {"model": model, "loss_fn": contrastive, "batches": make_pairs(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)}
