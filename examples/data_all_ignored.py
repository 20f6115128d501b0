"""Bad data: a batch made only of padding, so every label is ignore_index and the mean loss is 0/0.

A token tagger trains on sentences bucketed by length; a bucketing bug emits a batch at step 2
that holds nothing but padding. ``F.cross_entropy(..., ignore_index=-100)`` averages over the
labels that are not ignored — none here — and returns NaN.

Expected diagnosis: data, input, key batch.labels, step 2.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor


class Tagger(nn.Module):
    def __init__(self, vocab: int = 50, tags: int = 7, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.classifier = nn.Linear(dim, tags)

    def forward(self, tokens):
        return self.classifier(self.encoder(self.embed(tokens)))


def make_batches(steps: int = 6) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        tokens = torch.randint(1, 50, (8, 12), generator=g)
        labels = torch.randint(0, 7, (8, 12), generator=g)
        if step == 2:  # the bucketing bug: an all-padding batch
            tokens.zero_()
            labels.fill_(-100)
        out.append(Batch(tokens, labels))
    return out


def loss_fn(model, batch: Batch):
    logits = model(batch.tokens)
    return F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)


def target():
    torch.manual_seed(0)
    model = Tagger()
    return {"model": model, "loss_fn": loss_fn, "batches": make_batches(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3), "num_classes": 7}
