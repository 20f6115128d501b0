"""Healthy, but scary: -inf everywhere above the diagonal, by design.

A small language model built from ``nn.TransformerEncoderLayer`` is made
causal the way the PyTorch tutorials do it: an additive float mask from
``nn.Transformer.generate_square_subsequent_mask`` that holds ``-inf`` above
the diagonal, added to every attention score matrix. Every forward pass
creates and adds thousands of infinities; each row keeps its diagonal, so no
softmax row is entirely ``-inf`` and every probability is finite.

Intended ``-inf`` masks are not origins. Expected diagnosis: healthy, exit 0
from ``nanprobe run`` and ``nanprobe smoke --steps 30``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH_SIZE, N_STEPS, D_MODEL = 32, 16, 8, 30, 32


class CausalLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, d_model: int = D_MODEL):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(SEQ, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)   # 0 on and below the diagonal, -inf above
        h = self.encoder(self.embed(tokens) + self.pos[:t], mask=mask)
        return self.lm_head(h)


def make_batches(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_STEPS):
        start = torch.randint(0, VOCAB, (BATCH_SIZE, 1), generator=g)
        step = torch.randint(1, 4, (BATCH_SIZE, 1), generator=g)
        batches.append((start + step * torch.arange(SEQ + 1)) % VOCAB)   # arithmetic sequences mod VOCAB
    return batches


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def target():
    torch.manual_seed(0)
    model = CausalLM()
    return {"model": model, "loss_fn": next_token_loss, "batches": make_batches(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=3e-3), "max_grad_norm": 1.0,
            "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
