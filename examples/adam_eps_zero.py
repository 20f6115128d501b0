"""Adam with eps=0: embedding rows that get no gradient are updated with 0/0 = NaN.

A bag-of-tokens classifier has a vocabulary of 100 ids (room for tokens added
later), but the training data only uses ids below 50. The optimizer is
``Adam(..., eps=0.0)``, set to zero "to get the exact Adam update". A dense
``nn.Embedding`` gradient has a row for every id; rows whose ids are not in the
batch are exactly 0, so after the first step their ``exp_avg`` and
``exp_avg_sq`` are exactly 0 and Adam computes ``exp_avg / (sqrt(exp_avg_sq) + eps)``
= 0 / 0 = NaN for them: the very first update (step 0) writes NaN into every
row of ``embed.weight`` that batch 0 did not use - ids 50..99, which the data
never uses, and ids 2, 17 and 36, which batch 0 happens not to contain.

The loss and the gradients of step 0 are finite; only the parameters after the
update are not. The loss turns NaN at step 1, the first batch that looks up one
of those rows (had every id been in batch 0, the NaN rows 50..99 would sit
unnoticed until a new token appeared). The default ``eps=1e-8`` gives unused
rows an update of exactly 0.

Expected diagnosis: cause ``div``, phase ``update``, module ``embed``
(parameter ``embed.weight``, Adam's second moment exactly 0 with eps = 0),
step 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, USED_IDS, N_CLASSES, BATCH_SIZE, SEQ_LEN, N_STEPS = 100, 50, 4, 16, 12, 20


class BagOfTokens(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 16, n_classes: int = N_CLASSES):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.classifier = nn.Linear(dim, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(tokens).mean(dim=1))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_STEPS):
        tokens = torch.randint(0, USED_IDS, (BATCH_SIZE, SEQ_LEN), generator=g)
        label = tokens.mode(dim=1).values % N_CLASSES  # class of the most frequent token
        batches.append({"tokens": tokens, "label": label})
    return batches


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["tokens"]), batch["label"])


def target():
    torch.manual_seed(0)
    model = BagOfTokens()
    return {
        "model": model,
        "loss_fn": classification_loss,
        "batches": make_batches(),
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
