"""Healthy, but scary: fully padded rows through a safe attention kernel.

A sentence-pair classifier pads each batch to its longest sequence. Its
attention masks both the keys and the queries of padding positions, so the
score row of every padded query position attends to nothing: a fully masked
row, where a hand-written ``softmax`` gives 0/0 = NaN. The model calls
``F.scaled_dot_product_attention`` with a boolean mask instead; PyTorch's
kernel returns zeros for a row with nothing to attend to (finite forward and
backward), and the pooled output averages over real tokens only.

Expected diagnosis: healthy, exit 0 from ``nanprobe run`` and
``nanprobe smoke --steps 30``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, MAX_LEN, BATCH_SIZE, N_STEPS, D_MODEL, HEADS = 40, 12, 8, 30, 32, 4


@dataclass
class Batch:
    tokens: torch.Tensor     # (B, T) token ids, 0 = padding
    valid: torch.Tensor      # (B, T) True on real tokens
    labels: torch.Tensor     # (B,)


class MaskedAttention(nn.Module):
    def __init__(self, d_model: int = D_MODEL, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        # padded queries attend to nothing: their rows are fully masked (SDPA returns zeros there)
        allowed = (valid[:, None, :, None] & valid[:, None, None, :])
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(h.transpose(1, 2).reshape(b, t, c))


class PairClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL, padding_idx=0)
        self.attn = MaskedAttention()
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, 2)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = self.norm(h + self.attn(h, valid))
        pooled = (h * valid[..., None]).sum(1) / valid.sum(1, keepdim=True)
        return self.head(pooled)


def make_batches(seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_STEPS):
        lengths = torch.randint(3, MAX_LEN + 1, (BATCH_SIZE,), generator=g)
        t = int(lengths.max())
        tokens = torch.randint(1, VOCAB, (BATCH_SIZE, t), generator=g)
        valid = torch.arange(t)[None, :] < lengths[:, None]
        tokens = tokens.masked_fill(~valid, 0)
        labels = ((tokens * valid).sum(1) % 2)   # parity of the token sum
        batches.append(Batch(tokens=tokens, valid=valid, labels=labels))
    return batches


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch.tokens, batch.valid), batch.labels)


def target():
    torch.manual_seed(0)
    model = PairClassifier()
    return {"model": model, "loss_fn": loss_fn, "batches": make_batches(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
