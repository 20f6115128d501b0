"""fp16 + left padding: a mask value of -1e9 overflows to -inf and a fully masked row turns NaN.

A small GPT-style transformer is fine-tuned on left-padded batches (prompts padded on the left,
as for generation). The attention adds a mask bias of -1e9 on padding keys, built in float32 and
cast to the scores' dtype (the "extended attention mask" pattern), a constant copied from fp32 code. In fp32 that is harmless: a query row whose keys are all masked (a padding
position at the start of a left-padded sequence under the causal mask) gets a uniform softmax.
Under fp16 autocast the scores are fp16, -1e9 cannot be represented (max 65504) and becomes
-inf; the fully masked rows are then softmax over all -inf = 0/0 = NaN. The first left-padded
batch arrives at step 3.

Expected diagnosis: overflow, forward, module ``blocks.0.attn`` (the cast aten._to_copy to fp16),
finite in fp32 and bf16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH, PAD = 64, 64, 4, 2, 24, 8, 0


class PaddedAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        blocked = causal[None, None] | pad[:, None, None, :]           # (B, 1, T, T)
        bias = (blocked.float() * -1e9).to(scores.dtype)                 # fine in fp32, -inf in fp16
        scores = scores + bias
        out = scores.softmax(dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = PaddedAttention(D_MODEL, HEADS)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.ff = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x, pad):
        x = x + self.attn(self.ln1(x), pad)
        return x + self.ff(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, input_ids, attention_mask):
        pad = attention_mask == 0
        x = self.tok_emb(input_ids) + self.pos_emb(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x, pad)
        return self.lm_head(self.ln_f(x))


def make_batches(steps: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Full-length sequences until step 3, then left-padded prompts of varying length."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        if step >= 3:
            lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
            for i, n in enumerate(lengths.tolist()):
                mask[i, : SEQ - n] = 0
                ids[i, : SEQ - n] = PAD
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100)


def target():
    torch.manual_seed(0)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return {"model": model, "loss_fn": lm_loss, "batches": make_batches(), "optimizer": optimizer,
            "precision": "fp16", "grad_scaler": True, "max_grad_norm": 1.0}


if __name__ == "__main__":
    t = target()
    model, opt = t["model"], t["optimizer"]
    scaler = torch.amp.GradScaler("cpu")
    for step, batch in enumerate(t["batches"]):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model, batch)
        print(f"step {step}: loss {loss.item():.4f}")
        if not torch.isfinite(loss):
            break
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
