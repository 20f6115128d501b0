"""All labels ignored, with the project's own ignore_index (0, not -100).

A named-entity tagger pads label sequences with 0 ("no label") and tells the
loss so: ``F.cross_entropy(..., ignore_index=0)``; the target says
``"ignore_index": 0`` too. Batch 3 comes from a document made only of empty
lines: every label is padding, the mean is over zero labels, 0/0 = NaN.

The usual fix - count the valid labels and clamp the count at 1 - has to use
the project's ignore value. A fix template that hard-codes -100 would count
every padding position as valid here and silently train on padding.
Expected diagnosis: cause ``data`` (all labels ignored), phase ``input``,
step 3; the fix uses ``ignore_index=0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, N_TAGS, PAD_TO, BATCH_SIZE, N_STEPS, EMPTY_STEP, PAD = 60, 9, 10, 8, 6, 3, 0


class Tagger(nn.Module):
    def __init__(self, vocab: int = VOCAB, n_tags: int = N_TAGS, dim: int = 24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.proj = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, n_tags))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(tokens))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(N_STEPS):
        lengths = torch.zeros(BATCH_SIZE, dtype=torch.long) if step == EMPTY_STEP else \
            torch.randint(2, PAD_TO + 1, (BATCH_SIZE,), generator=g)
        tokens = torch.randint(1, VOCAB, (BATCH_SIZE, PAD_TO), generator=g)
        valid = torch.arange(PAD_TO)[None, :] < lengths[:, None]
        tokens = tokens.masked_fill(~valid, PAD)
        labels = (tokens % (N_TAGS - 1) + 1).masked_fill(~valid, PAD)       # tags 1..8, 0 = padding
        batches.append({"tokens": tokens, "labels": labels})
    return batches


def tag_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.reshape(-1, N_TAGS), batch["labels"].reshape(-1), ignore_index=PAD)


def target():
    torch.manual_seed(0)
    model = Tagger()
    return {"model": model, "loss_fn": tag_loss, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp32", "ignore_index": PAD}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
