"""nanoGPT (manual attention path) with a left-padding key mask of -1e9 cast to the fp16 attention scores.

Source: https://github.com/karpathy/nanoGPT, model.py, commit 3adf61e154c3fe3fca428ad6bc3818b27a3b8291, license MIT.
Changed: GPT shrunk to 2 layers, 2 heads, 64 wide, block_size 64, on the zoo's char corpus; the attention uses
nanoGPT's manual (non-flash) path plus a key-padding mask written the way transformers models built theirs
(additive (1 - mask) * -1e9, cast to the scores' dtype: PR huggingface/transformers#17306 discusses the fp16
version of this); sequences are 64-character windows, and a document's short tail is left-padded (pad
targets ignored with -1); trained under fp16 autocast with AdamW 1e-3, batch 8.
Kind: broken. -1e9 does not fit fp16 (max 65504), so the cast mask is -inf; a left-padded sequence's first
query can only see pad keys (causal), its score row is all -inf and softmax returns NaN in
transformer.h.0.attn, at the first batch holding a padded tail (step 4; loss 3.37 -> 2.99 before). In fp32
the same mask is finite and the row is uniform (harmless). Using torch.finfo(att.dtype).min for the fill
value holds (final level 2.12).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import char_corpus  # noqa: E402

STEPS = 60
KIND = "broken"
FIXES = {"finfo_min": "fill masked keys with torch.finfo(att.dtype).min instead of -1e9 (fits fp16)",
         "bf16": "train in bf16 autocast instead of fp16 (-1e9 is within its range)"}
TRUTH = {"cause": "overflow", "mechanism": None, "module": "transformer.h.0.attn", "onset": None,
         "how": ('Public report: https://github.com/huggingface/transformers/pull/17306 (attention-mask values that '
                 'overflow fp16 give rows of -inf and NaN after softmax when a row is fully masked, e.g. causal + '
                 'padding). Op: ((1.0 - pad_mask) * -1e9).to(float16) overflows to -inf (fp16 max 65504); added to the '
                 'scores in transformer.h.0.attn, the first query of a left-padded sequence sees only pad keys (the '
                 'rest are causally masked), its row is all -inf and F.softmax returns NaN; the first batch holding a '
                 'padded tail is step 4 (loss 3.37 -> 2.99 over steps 0-3). In fp32 the same mask is finite and '
                 'harmless.')}
MASK_VALUE = {"value": -1e9}


class LayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x, pad_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # manual implementation of attention
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        if pad_mask is not None:   # added: key padding mask, (1 - mask) * big negative, in the scores' dtype
            fill = torch.finfo(att.dtype).min if MASK_VALUE["value"] == "finfo" else MASK_VALUE["value"]
            att = att + ((1.0 - pad_mask[:, None, None, :]) * fill).to(att.dtype)
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, pad_mask=None):
        x = x + self.attn(self.ln_1(x), pad_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPTConfig:   # nanoGPT's @dataclass GPTConfig, as a plain class (the zoo loads programs without sys.modules)
    def __init__(self, block_size=64, vocab_size=64, n_layer=2, n_head=2, n_embd=64, dropout=0.0, bias=True):
        self.block_size, self.vocab_size, self.n_layer, self.n_head = block_size, vocab_size, n_layer, n_head
        self.n_embd, self.dropout, self.bias = n_embd, dropout, bias


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, pad_mask=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, pad_mask)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def make_samples(seed=0):
    """64+1-character windows of each document; a document's short tail is left-padded (pad id 0)."""
    text = char_corpus(60000, seed=seed)
    chars = sorted(set(text))
    stoi = {c: i + 1 for i, c in enumerate(chars)}
    docs = [text[i:i + 1300] for i in range(0, len(text), 1300)]
    samples = []
    for d in docs:
        ids = [stoi[c] for c in d]
        for s in range(0, len(ids) - 1, 64):
            chunk = ids[s:s + 65]
            if len(chunk) < 2:
                continue
            n_pad = 65 - len(chunk)
            x = [0] * n_pad + chunk[:-1]
            y = [-1] * n_pad + chunk[1:]
            m = [0.0] * n_pad + [1.0] * (len(chunk) - 1)
            samples.append((x, y, m))
    return samples, len(chars) + 1


def loss_fn(model, batch):
    x, y, m = batch
    _, loss = model(x, y, pad_mask=m)
    return loss


def target(config=None):
    fix = (config or {}).get("fix")
    MASK_VALUE["value"] = "finfo" if fix == "finfo_min" else -1e9
    torch.manual_seed(0)
    samples, vocab = make_samples()
    x = torch.tensor([s[0] for s in samples])
    y = torch.tensor([s[1] for s in samples])
    m = torch.tensor([s[2] for s in samples])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, m), batch_size=8, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(0))
    model = GPT(GPTConfig(vocab_size=vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    return {"model": model, "loss_fn": loss_fn, "batches": loader, "epochs": 5, "optimizer": opt,
            "precision": "bf16" if fix == "bf16" else "fp16"}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
