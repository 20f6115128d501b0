"""fp16 overflow of the attention scores: q @ k^T exceeds 65504 before it is scaled.

A small GPT-style model (``tiny_transformer.py``: pre-LN blocks, hand-written
multi-head attention computing ``(q @ k.transpose(-2, -1)) / math.sqrt(d)``) is
trained with Adam at a peak learning rate of 0.13 after 4 warmup steps. That
learning rate came out of a sweep run in bf16 on an A100, where it trains
without a single non-finite value; the same recipe is now run in fp16 with a
GradScaler on a GPU without bf16.

A learning rate this high makes the attention logits grow fast ("attention
logit growth", the instability that QK-LayerNorm was introduced for): Adam
moves every q/k weight by about the learning rate per step, so |q . k| grows by
roughly 1.3-2x per step. In fp32 and bf16 that is harmless for a while (bf16
has fp32's range). In fp16 the product is rounded to fp16 *before* the
``/ math.sqrt(d)`` scaling: at step 9 one entry of ``q @ k^T`` in
``blocks.0.attn`` exceeds fp16's maximum of 65504 (it is ~7.5e4 in fp32), the
score becomes +inf and the softmax of that row is inf - inf = NaN. The loss is
NaN, the GradScaler sees inf gradients and skips the step, and so on.
No earlier step has any non-finite value, masked or not (the largest
|q . k| before step 9 is ~6.0e4, at step 8).

Rerunning step 9 from the same state in fp32 or bf16 gives a finite loss.
Scaling q by 1/sqrt(d) before the matmul (or calling
``F.scaled_dot_product_attention``), training in bf16, or lowering the learning
rate all avoid it.

Expected diagnosis: cause ``overflow``, phase ``forward``, module
``blocks.0.attn``, op ``aten.bmm`` (``q @ k^T`` on 4-D tensors), step 9,
finite in fp32 and bf16.
"""

from __future__ import annotations

import torch

try:  # imported as part of a package (``examples.fp16_attention_overflow``)
    from .tiny_transformer import TinyTransformer, TransformerConfig, copy_task_batches, lm_loss
except ImportError:  # run as a script or loaded from its path
    from tiny_transformer import TinyTransformer, TransformerConfig, copy_task_batches, lm_loss

SEED = 7
N_STEPS = 14
PEAK_LR = 0.13
WARMUP_STEPS = 4


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP_STEPS)


def target():
    torch.manual_seed(SEED)
    cfg = TransformerConfig(vocab_size=64, max_len=32, d_model=128, n_heads=2, n_layers=2)
    model = TinyTransformer(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=PEAK_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    batches = copy_task_batches(N_STEPS, batch_size=8, seq_len=cfg.max_len,
                                vocab_size=cfg.vocab_size, seed=SEED)
    return {
        "model": model,
        "loss_fn": lm_loss,              # batches are (tokens, targets) tuples
        "batches": batches,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "precision": "fp16",
        "grad_scaler": True,
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
