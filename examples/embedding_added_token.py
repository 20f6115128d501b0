"""A raise that is data: a token id past the embedding table.

A language model was trained with a 100-token vocabulary; for fine-tuning the
tokenizer got two special tokens (``<user>`` = 100, ``<bot>`` = 101), but the
model's ``nn.Embedding(100, ...)`` was not resized. The first batches happen
to contain no chat turns; batch 2 is the first with a ``<bot>`` token, and
the embedding lookup raises ``IndexError: index out of range in self`` - no
NaN ever exists. Before, nanprobe called this a bug in the user's code
(exit 2); it is the data (and the table) not matching.

Expected diagnosis: cause ``data``, phase ``input``, step 2, with the key
``batch['input_ids']``, the offending id and sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BASE_VOCAB, USER, BOT, SEQ, BATCH_SIZE, N_STEPS = 100, 100, 101, 16, 8, 6


class TinyLM(nn.Module):
    def __init__(self, vocab: int = BASE_VOCAB, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)           # not resized after adding <user>, <bot>
        self.mix = nn.GRU(dim, dim, batch_first=True)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.mix(self.embed(ids))
        return self.lm_head(h)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(N_STEPS):
        ids = torch.randint(0, BASE_VOCAB, (BATCH_SIZE, SEQ + 1), generator=g)
        if step >= 2:                                   # chat transcripts from here on
            ids[3, 0], ids[3, 8] = USER, BOT
        batches.append({"input_ids": ids})
    return batches


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].clamp_max(BASE_VOCAB - 1).reshape(-1))


def target():
    torch.manual_seed(0)
    model = TinyLM()
    return {"model": model, "loss_fn": lm_loss, "batches": make_batches(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
