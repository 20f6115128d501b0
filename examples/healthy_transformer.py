"""Healthy: a small GPT-style transformer in bf16 autocast with AdamW, warmup-cosine LR and clipping.

20 clean steps on a synthetic copy task; finite in fp32, bf16 and fp16. nanprobe exits 0 with no
finding. Also the model for scripts/bench_run.py and scripts/bench_guard.py.
"""

import math

import torch

from tiny_transformer import TinyTransformer, TransformerConfig, copy_task_batches, lm_loss

STEPS, WARMUP = 20, 5


def warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def target():
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    return {"model": model, "loss_fn": lm_loss,
            "batches": copy_task_batches(STEPS, batch_size=8, seq_len=32, vocab_size=64, seed=0),
            "optimizer": optimizer, "scheduler": scheduler, "max_grad_norm": 1.0, "precision": "bf16"}
