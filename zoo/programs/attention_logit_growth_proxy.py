"""Small-scale proxy of attention-logit growth (Wortsman et al. 2023): a pre-LN nanoGPT at a high LR, no qk-layernorm.

Source: https://github.com/karpathy/nanoGPT, model.py, commit 3adf61e154c3fe3fca428ad6bc3818b27a3b8291, license MIT.
Changed: GPT shrunk to 2 layers, 4 heads, n_embd 64, block 64, on zoo/_data.char_corpus characters (made
here, nothing downloaded); CausalSelfAttention uses model.py's "manual implementation of attention" path
(softmax of q.k/sqrt(d)), with the paper's optional qk-layernorm (a LayerNorm on q and k) added behind a flag;
train.py's AdamW (betas 0.9/0.95, wd 0.1, decayed params as configure_optimizers) with get_lr's linear
warm-up (100 steps) and decay_lr = False, peak LR 0.3 (too high); batch 16; 300 steps.
Kind: trajectory. Warm-up to LR 0.3 over 100 steps, then constant (train.py's decay_lr =
False). Layer 0's largest attention logit |q.k|/sqrt(d) grows from 0.15 to 2.7e4 during the warm-up (its
attention entropy 3.86 -> 0.003, one-hot); the loss level still bottoms at 2.53 (step 62). Once the LR
peaks, layer 1's logits leave their 100-245 plateau (1617 at step 115, 1e4+ later) and the loss breaks
away to ~2.8 for the rest of the run (held-out 3.28 -> 2.80). qk-layernorm
(held-out 1.99) or peak LR 3e-3 (0.68) holds; an output z-loss does not touch the attention logits and
does not hold.
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

STEPS = 300
KIND = "trajectory"
FIXES = {"qk_layernorm": "LayerNorm on q and k before the dot product (Wortsman et al. 2023, Dehghani et al. 2023)",
         "lr": "peak LR 3e-3 instead of 0.3",
         "z_loss": "add 1e-4 * logsumexp(logits)^2 to the loss (output-logit z-loss only)"}
TRUTH = {"cause": "lr_spike", "mechanism": "attention_logit_growth", "module": "transformer.h.1.attn",
         "onset": [101, 115],
         "how": "measure()'s h1_max_logit (largest |q.k|/sqrt(d) of transformer.h.1.attn on a fixed held-out "
                "batch) sits at 100-245 (median 155) over steps 30-100; it first exceeds that plateau's maximum "
                "at step 101 (268) and 10x its median at step 115 (1617, attention entropy 1.2 -> 0.6), reaching "
                "1e4-9e4 later. Layer 0's logits had already grown 0.15 -> 2.7e4 during the warm-up (entropy "
                "~0.003) while the loss still improved. The loss level bottoms at 2.53 (step 62) and breaks "
                "away after step 100 to ~2.8 (zoo/truth/attention_logit_growth_proxy.log)"}

LR_PEAK, WARMUP, DECAY_LR, BATCH, BLOCK = 0.3, 100, False, 16, 64


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
        self.qk_layernorm = config.qk_layernorm
        if self.qk_layernorm:
            self.q_ln = LayerNorm(config.n_embd // config.n_head, bias=config.bias)
            self.k_ln = LayerNorm(config.n_embd // config.n_head, bias=config.bias)
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))
        self.stats = {}

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.qk_layernorm:
            q, k = self.q_ln(q), self.k_ln(k)
        # manual implementation of attention
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        with torch.no_grad():
            self.stats["max_logit"] = float(att.masked_fill(self.bias[:, :, :T, :T] == 0, 0).abs().max())
        att = F.softmax(att, dim=-1)
        with torch.no_grad():
            ent = -(att * torch.log(att.clamp_min(1e-30))).sum(-1)[:, :, T // 2:]
            self.stats["entropy"] = float(ent.mean())
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

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPTConfig:
    """model.py's GPTConfig dataclass, as a plain class (same fields and defaults)."""

    def __init__(self, block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0,
                 bias=True, qk_layernorm=False):
        self.block_size, self.vocab_size, self.n_layer, self.n_head = block_size, vocab_size, n_layer, n_head
        self.n_embd, self.dropout, self.bias, self.qk_layernorm = n_embd, dropout, bias, qk_layernorm


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

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def data():
    text = char_corpus(60000)
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.long), len(chars)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(1337)
    ids, vocab = data()
    n_val = len(ids) // 10
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    model = GPT(GPTConfig(block_size=BLOCK, vocab_size=vocab, n_layer=2, n_head=4, n_embd=64,
                          qk_layernorm=fix == "qk_layernorm"))
    g = torch.Generator().manual_seed(val_ids.numel())
    ix = torch.randint(len(val_ids) - BLOCK - 1, (32,), generator=g)
    model.val_batch = (torch.stack([val_ids[i:i + BLOCK] for i in ix]), torch.stack([val_ids[i + 1:i + 1 + BLOCK] for i in ix]))

    def batches(step):
        g = torch.Generator().manual_seed(step)
        ix = torch.randint(len(train_ids) - BLOCK - 1, (BATCH,), generator=g)
        return torch.stack([train_ids[i:i + BLOCK] for i in ix]), torch.stack([train_ids[i + 1:i + 1 + BLOCK] for i in ix])

    zl = 1e-4 if fix == "z_loss" else 0.0

    def loss_fn(model, batch):
        x, y = batch
        logits, loss = model(x, y)
        if zl:
            loss = loss + zl * torch.logsumexp(logits, -1).pow(2).mean()
        return loss

    peak = 3e-3 if fix == "lr" else LR_PEAK
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    nodecay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=peak, betas=(0.9, 0.95))

    def get_lr(it):  # train.py's get_lr as a multiplier
        if it < WARMUP:
            return (it + 1) / (WARMUP + 1)
        if not DECAY_LR:
            return 1.0
        ratio = (it - WARMUP) / (STEPS - WARMUP)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * ratio))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, get_lr)
    return {"model": model, "batches": batches, "loss_fn": loss_fn, "optimizer": opt, "scheduler": sched}


def measure(model, step):
    """Truth-side precursors: per layer, the largest |q.k|/sqrt(d) and the mean attention entropy on a fixed batch."""
    model.eval()
    x, y = model.val_batch
    _, loss = model(x, y)
    model.train()
    out = {"val_loss": float(loss)}
    for i, blk in enumerate(model.transformer.h):
        out[f"h{i}_max_logit"] = blk.attn.stats["max_logit"]
        out[f"h{i}_entropy"] = blk.attn.stats["entropy"]
    return out


def evaluate(model):
    """Held-out loss on a fixed batch of the last 10% of the text."""
    model.eval()
    with torch.no_grad():
        _, loss = model(*model.val_batch)
    model.train()
    return float(loss)


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
