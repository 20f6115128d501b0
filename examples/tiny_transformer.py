"""A small decoder-only transformer shared by the transformer examples.

Written the way many people write their first GPT: a hand-rolled multi-head
attention with separate q/k/v/o projections, pre-LayerNorm residual blocks, a
GELU feed-forward and a tied-free LM head. Nothing in here is wrong on its own;
the examples that import it differ only in how they configure and train it.

Qualified module names (what ``model.named_modules()`` reports):
``tok_emb``, ``pos_emb``, ``blocks.<i>.ln1``, ``blocks.<i>.attn`` (with
``.q``, ``.k``, ``.v``, ``.o``, and ``.q_norm``/``.k_norm`` when ``qk_norm=True``), ``blocks.<i>.ln2``, ``blocks.<i>.ff`` (with
``.fc1``, ``.act``, ``.fc2``), ``ln_f``, ``lm_head``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TransformerConfig:
    vocab_size: int = 64
    max_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    ff_mult: int = 4
    init_std: float = 0.02
    qk_norm: bool = False        # LayerNorm on q and k per head before q @ k^T (the qk-layernorm cure)


class MultiHeadAttention(nn.Module):
    """Causal self-attention, written out by hand."""

    def __init__(self, d_model: int, n_heads: int, max_len: int, qk_norm: bool = False):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)
        mask = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # The textbook formula, scaled after the matmul.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.causal_mask[:t, :t], float("-inf"))
        weights = scores.softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, t, c)
        return self.o(out)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln1(x)), then x + ff(ln2(x))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.max_len, cfg.qk_norm)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ff = FeedForward(cfg.d_model, cfg.ff_mult * cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.ff(self.ln2(x))
        return x


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy; batches are ``(tokens, targets)`` tuples."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def copy_task_batches(n_steps: int, batch_size: int, seq_len: int, vocab_size: int,
                      seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic 'induction' text: a random half-sequence followed by a repeat of it.

    Predicting the second half requires attending back to the first, which is
    what makes a transformer learn sharp attention.
    """
    g = torch.Generator().manual_seed(seed)
    half = (seq_len + 1) // 2
    batches = []
    for _ in range(n_steps):
        first = torch.randint(0, vocab_size, (batch_size, half), generator=g)
        seq = torch.cat([first, first], dim=1)[:, : seq_len + 1]
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return batches
