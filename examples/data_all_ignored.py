"""A batch of blank lines: every label is ``ignore_index``, so the mean loss is 0/0.

A part-of-speech tagger reads a CoNLL-style file in order (no shuffling) and
pads every sentence to a fixed length with token 0 / label -100. The file has a
run of empty sentences (blank lines between documents that the reader keeps as
zero-length sentences), and at step 2 a whole batch consists of them.
``F.cross_entropy(..., ignore_index=-100)`` averages over the labels that are
not ignored; there are none, so the loss is 0/0 = NaN even though every
activation is finite. The gradients of that step are exactly zero (an empty
mean contributes nothing), so the weights survive: only the loss, and every
metric averaged over it, is NaN.

Expected diagnosis: cause ``data`` (all labels ignored), phase ``input``, no
module; step 2, batch field ``labels`` (every sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, N_TAGS, PAD_TO, BATCH_SIZE, N_STEPS = 50, 7, 12, 8, 20
IGNORE = -100


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, PAD_TO) token ids, 0 = padding
    labels: torch.Tensor  # (B, PAD_TO) tag ids, IGNORE on padding


class Tagger(nn.Module):
    def __init__(self, vocab: int = VOCAB, n_tags: int = N_TAGS, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.classifier = nn.Linear(dim, n_tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(self.embed(tokens)))


def read_sentences(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Sentences as (token ids, tag ids); 16..23 are the blank lines between two documents."""
    g = torch.Generator().manual_seed(seed)
    sentences = []
    for i in range(BATCH_SIZE * N_STEPS):
        n = 0 if 16 <= i < 24 else int(torch.randint(3, PAD_TO + 1, (), generator=g))
        tokens = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        tags = [t % N_TAGS for t in tokens]  # a learnable token -> tag rule
        sentences.append((tokens, tags))
    return sentences


def collate(sentences: list[tuple[list[int], list[int]]]) -> Batch:
    tokens = torch.zeros(len(sentences), PAD_TO, dtype=torch.long)
    labels = torch.full((len(sentences), PAD_TO), IGNORE, dtype=torch.long)
    for i, (tok, tag) in enumerate(sentences):
        tokens[i, : len(tok)] = torch.tensor(tok, dtype=torch.long)
        labels[i, : len(tag)] = torch.tensor(tag, dtype=torch.long)
    return Batch(tokens, labels)


def tagging_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(batch.tokens)
    return F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE)


def target():
    torch.manual_seed(0)
    model = Tagger()
    sentences = read_sentences()
    batches = [collate(sentences[i:i + BATCH_SIZE]) for i in range(0, len(sentences), BATCH_SIZE)]
    return {
        "model": model,
        "loss_fn": tagging_loss,
        "batches": batches,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
