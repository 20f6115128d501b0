"""Divergence from step 1: AdamW with ``lr=20`` (a config typo).

A text classifier is trained with AdamW. The learning rate comes from a YAML
file where ``lr: 20`` was typed for ``lr: 2e-3``; nothing checks it. Adam's
first update moves every weight by about the learning rate (m / sqrt(v) is
about +-1 per element at step 0), so weights of size 0.1 become size 20: the
median |dw|/|w| over the parameters is about 200 in that one step. The loss
goes from 1.79 at step 0 to 1.3e5 at step 1 and stays in the thousands. No
NaN, and no history of a "normal" loss to compare with: a spike rule that
needs a running median calls step 1 healthy, and ``smoke`` passes.

Expected diagnosis: cause ``lr_spike``, phase ``update``, step 1 (the loss is
7e4 times the first loss), evidence: the LR (20, constant) and |dw|/|w| of
step 0. ``nanprobe run --at 1`` says the same; ``--at 0`` flags the update of
step 0 itself (|dw|/|w| = 22 measured at that step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, N_CLASSES, BATCH_SIZE, N_STEPS = 100, 12, 6, 16, 12
LR = 20.0   # from the config file: meant 2e-3


class BagOfWords(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 32, n_classes: int = N_CLASSES):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.hidden = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.hidden(self.embed(tokens))))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH_SIZE, SEQ), generator=g)
        batches.append({"tokens": tokens, "labels": tokens[:, 0] % N_CLASSES})   # the first token decides
    return batches


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["tokens"]), batch["labels"])


def target():
    torch.manual_seed(0)
    model = BagOfWords()
    return {"model": model, "loss_fn": loss_fn, "batches": make_batches(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
