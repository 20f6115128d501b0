"""Optimizer update 0/0: Adam with eps=0 and embedding rows that never receive a gradient.

Someone set ``eps=0.0`` "to be exact". Adam's update is m / (sqrt(v) + eps). The vocabulary has
100 tokens but the data only ever uses ids below 50, so half of the embedding rows have m = v = 0
and the very first update computes 0/0 = NaN in them. Forward and backward are finite; the NaN
is born inside optimizer.step().

Expected diagnosis: div, update, module ``embed`` (parameter embed.weight).
"""

import torch
import torch.nn.functional as F
from torch import nn


class BagOfWords(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 16, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


def make_batches(steps: int = 5):
    g = torch.Generator().manual_seed(0)
    return [{"ids": torch.randint(0, 50, (8, 10), generator=g), "label": torch.randint(0, 3, (8,), generator=g)}
            for _ in range(steps)]


def target():
    torch.manual_seed(0)
    model = BagOfWords()
    return {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b["ids"]), b["label"]),
            "batches": make_batches(), "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)}
