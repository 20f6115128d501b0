"""0/0 in an L2 normalisation without eps: an empty document has an all-zero embedding.

A text classifier embeds TF-IDF vectors with ``Linear(bias=False) + ReLU``,
L2-normalises the embedding in its ``normalize`` module with
``x / x.norm(dim=-1, keepdim=True)`` and classifies the unit vector (a
cosine-style classifier). At step 3 the batch contains a document whose text
was empty after preprocessing (sample 6: only stop words), so its TF-IDF
vector is all zeros, the bias-free projection and the ReLU give exactly zero,
its norm is 0 and the division is 0/0 = NaN, in fp32, in the forward pass.
``F.normalize(x, dim=-1)`` (which clamps the norm with eps=1e-12) avoids it.

Expected diagnosis: cause ``div``, phase ``forward``, module ``normalize``
(``aten.div``), step 3, sample 6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, N_CLASSES, BATCH_SIZE, N_STEPS = 200, 4, 16, 20


class L2Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class CosineTextClassifier(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 32, n_classes: int = N_CLASSES, scale: float = 10.0):
        super().__init__()
        self.embed = nn.Linear(vocab, dim, bias=False)
        self.act = nn.ReLU()
        self.normalize = L2Normalize()
        self.classifier = nn.Linear(dim, n_classes)
        self.scale = scale

    def forward(self, tfidf: torch.Tensor) -> torch.Tensor:
        return self.scale * self.classifier(self.normalize(self.act(self.embed(tfidf))))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sparse TF-IDF rows; each class prefers its own slice of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(N_STEPS):
        label = torch.randint(0, N_CLASSES, (BATCH_SIZE,), generator=g)
        counts = torch.poisson(torch.full((BATCH_SIZE, VOCAB), 0.05), generator=g)
        for i, c in enumerate(label.tolist()):  # topic words of the document's class
            lo = c * VOCAB // N_CLASSES
            counts[i, lo:lo + 10] += torch.poisson(torch.full((10,), 1.0), generator=g)
        if step == 3:
            counts[6] = 0.0  # a document that was only stop words: nothing left after cleaning
        tf = counts / counts.sum(-1, keepdim=True).clamp(min=1.0)
        tfidf = tf * torch.log(torch.tensor(1.0 + VOCAB))
        batches.append({"tfidf": tfidf, "label": label})
    return batches


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["tfidf"]), batch["label"])


def target():
    torch.manual_seed(0)
    model = CosineTextClassifier()
    return {
        "model": model,
        "loss_fn": classification_loss,
        "batches": make_batches(),
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
