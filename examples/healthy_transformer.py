"""Healthy: a small GPT-style transformer in bf16 autocast with AdamW, warmup-cosine LR and clipping.

The model of ``tiny_transformer.py`` (2 pre-LN blocks, hand-written attention)
trains 20 clean steps on a synthetic copy task with a sane recipe: AdamW at
1e-3, 5 linear warmup steps then cosine decay, ``max_grad_norm=1.0``, bf16
autocast. Every loss, gradient and weight stays finite, and the same 20 steps
are also finite in fp32 and in fp16 (with or without a GradScaler): with the
default init std of 0.02 the attention logits stay far below fp16's range.
Also the model for ``scripts/bench_run.py`` and ``scripts/bench_guard.py``.

Expected diagnosis: healthy - no finding, exit code 0.
"""

from __future__ import annotations

import math

import torch

try:  # imported as part of a package (``examples.healthy_transformer``)
    from .tiny_transformer import TinyTransformer, TransformerConfig, copy_task_batches, lm_loss
except ImportError:  # run as a script or loaded from its path
    from tiny_transformer import TinyTransformer, TransformerConfig, copy_task_batches, lm_loss

STEPS, WARMUP = 20, 5


def warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def target(config: dict | None = None):
    """``config`` (optional) scales the model for benchmarks: d_model, n_layers, n_heads, seq_len, batch_size,
    vocab_size, and ``steps`` (batches; 20 by default)."""
    cfg = dict(config or {})
    seq_len, batch_size, steps = cfg.pop("seq_len", 32), cfg.pop("batch_size", 8), cfg.pop("steps", STEPS)
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(max_len=max(32, seq_len), **cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    return {"model": model, "loss_fn": lm_loss,
            "batches": copy_task_batches(steps, batch_size=batch_size, seq_len=seq_len, vocab_size=64, seed=0),
            "optimizer": optimizer, "scheduler": scheduler, "max_grad_norm": 1.0, "precision": "bf16"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=STEPS)
