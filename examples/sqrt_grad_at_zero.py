"""sqrt's gradient at 0: a pair of identical items makes the Euclidean distance exactly 0.

A siamese network learns product embeddings with a contrastive loss on the
distance ``sqrt(((a - b) ** 2).sum(-1))`` computed in its ``distance`` module.
Pairs are mined per anchor: even anchors get a positive (another item of the
same class), odd anchors a negative. The miner falls back to the anchor itself
when its class has no other member, and one class has a single product. At
step 4 that product is an anchor of a positive pair (sample 2), so both sides
of the pair are the same tensor, both embeddings are bitwise equal, and the
distance is exactly 0.

The forward pass is fine (sqrt(0) = 0, and the loss ``d ** 2`` is 0 for that
pair). The backward pass is not: d sqrt(s)/ds = 1 / (2 sqrt(s)) is infinite at
s = 0, and ``SqrtBackward0`` computes 0 / 0 = NaN for that sample, which the
chain rule spreads into every encoder weight. ``torch.cdist``/``F.pairwise_distance``
(which add an eps) or ``sqrt(s + eps)`` avoid it.

Expected diagnosis: cause ``sqrt``, phase ``backward``, module ``distance``
(autograd node ``SqrtBackward0``), step 4, sample 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, PAIRS_PER_BATCH, N_STEPS, N_CLASSES = 10, 12, 20, 8


class EuclideanDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))


class SiameseNet(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, dim: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(n_features, 32), nn.ReLU(), nn.Linear(32, dim))
        self.distance = EuclideanDistance()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.distance(self.encoder(a), self.encoder(b))


def make_dataset(seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Items and their class; item 50 is the only member of the last class."""
    g = torch.Generator().manual_seed(seed)
    n_items = PAIRS_PER_BATCH * N_STEPS
    centers = 3.0 * torch.randn(N_CLASSES + 1, N_FEATURES, generator=g)
    classes = [int(c) for c in torch.randint(0, N_CLASSES, (n_items,), generator=g)]
    classes[50] = N_CLASSES  # a product category with a single item
    items = centers[classes] + torch.randn(n_items, N_FEATURES, generator=g)
    return items, classes


def mine_pairs(items: torch.Tensor, classes: list[int], seed: int = 1):
    """(anchor, other, same) tuples, one batch per step, anchors in dataset order."""
    g = torch.Generator().manual_seed(seed)
    by_class: dict[int, list[int]] = {}
    for i, c in enumerate(classes):
        by_class.setdefault(c, []).append(i)
    batches = []
    for start in range(0, len(classes), PAIRS_PER_BATCH):
        anchors, others, same = [], [], []
        for k, i in enumerate(range(start, start + PAIRS_PER_BATCH)):
            if k % 2 == 0:  # positive: another item of the same class
                candidates = [j for j in by_class[classes[i]] if j != i] or [i]
            else:           # negative: any item of another class
                candidates = [j for j, c in enumerate(classes) if c != classes[i]]
            j = candidates[int(torch.randint(0, len(candidates), (), generator=g))]
            anchors.append(i)
            others.append(j)
            same.append(float(k % 2 == 0))
        batches.append((items[anchors], items[others], torch.tensor(same)))
    return batches


def contrastive_loss(model: nn.Module, batch, margin: float = 2.0) -> torch.Tensor:
    a, b, same = batch
    d = model(a, b)
    return (same * d ** 2 + (1 - same) * F.relu(margin - d) ** 2).mean()


def target():
    torch.manual_seed(0)
    model = SiameseNet()
    items, classes = make_dataset()
    return {
        "model": model,
        "loss_fn": contrastive_loss,
        "batches": mine_pairs(items, classes),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
