"""A raise that is an overflow: ``masked_fill(mask, -1e9)`` on an fp16 tensor.

An attention block written for fp32 masks padding with a large negative
constant, ``scores.masked_fill(pad, -1e9)``. The team switches to fp16
autocast: ``scores`` is now float16, whose most negative value is -65504, and
PyTorch refuses to write -1e9 into it: ``RuntimeError: value cannot be
converted to type at::Half without overflow`` at the first step. No NaN, and
the code is fine in fp32.

Expected diagnosis: cause ``overflow`` (a constant beyond the fp16 range),
phase ``forward``, module ``attn``, step 0; fix
``torch.finfo(scores.dtype).min``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, BATCH_SIZE, N_STEPS = 30, 10, 32, 8, 4


class PaddedAttention(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])
        scores = scores.masked_fill(pad[:, None, :], -1e9)       # fine in fp32, not in fp16
        return scores.softmax(-1) @ v


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.attn = PaddedAttention()
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0
        h = self.attn(self.embed(ids), pad)
        return self.head(h.mean(1))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_STEPS):
        ids = torch.randint(1, VOCAB, (BATCH_SIZE, SEQ), generator=g)
        ids[:, 7:] = 0                                  # padding
        batches.append({"ids": ids, "label": ids[:, 0] % 2})
    return batches


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["ids"]).float(), batch["label"])


def target():
    torch.manual_seed(0)
    model = Classifier()
    return {"model": model, "loss_fn": loss_fn, "batches": make_batches(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3), "precision": "fp16", "grad_scaler": True}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
