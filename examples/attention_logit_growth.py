"""Attention-logit growth at a high learning rate: a slow divergence in bf16, a NaN in fp16.

A small-scale proxy of Wortsman et al., "Small-scale proxies for large-scale
Transformer training instabilities" (arXiv 2309.14322): the model of
``tiny_transformer.py`` (2 pre-LN blocks, hand-written attention computing
``(q @ k.transpose(-2, -1)) / math.sqrt(d)``) trained on a synthetic copy task
with the usual recipe - AdamW (beta2 0.95, eps 1e-8), clipping at 1.0, linear
warmup then cosine decay - but at a peak learning rate far above what this
model tolerates.

Nothing fails on the step where the trouble begins. Adam moves each q/k weight
by about the learning rate per step whatever its gradient, so the pre-softmax
logits ``q . k / sqrt(d)`` grow from ~1 at init to hundreds and thousands, the
attention entropy collapses to ~0 (each query attends to one key, one-hot) and
the attention gradients vanish through the saturated softmax. Then:

- ``target()``, bf16 autocast: bf16 has fp32's range, so nothing overflows. The
  loss first improves, then breaks away from its best level and never comes
  back: a slow divergence with every value finite. A NaN detector calls it
  healthy.
- ``target_fp16()``, fp16 autocast + GradScaler: the growing logits are
  computed in fp16; ``q @ k^T`` (before the ``/ sqrt(d)``) passes 65504 after
  tens of steps of growth and the run ends in NaN. The op that overflows first
  is only where the growth was finally caught.

``control_qk_norm.py`` is the same model, data and recipe with qk-layernorm
(``TransformerConfig(qk_norm=True)``: LayerNorm on q and k per head): the logits
stay bounded and the run is healthy at the same learning rate.

Expected diagnosis: mechanism ``attention_logit_growth`` in ``blocks.<i>.attn``
with an onset tens of steps before the failure; bf16: ``status: diverging``;
fp16: ``overflow`` (non-finite) at the step the plain loop reports.
"""

from __future__ import annotations

import math

import torch

try:  # imported as part of a package (``examples.attention_logit_growth``)
    from .tiny_transformer import TinyTransformer, TransformerConfig, lm_loss
except ImportError:  # run as a script or loaded from its path
    from tiny_transformer import TinyTransformer, TransformerConfig, lm_loss

SEED = 0
STEPS = 120          # batches in the run (bf16 on CPU is slow: keep it short)
SCHEDULE = 2000      # the planned run the cosine decays over: the proxy is its first STEPS steps
WARMUP = 60
PEAK_LR = 0.15
MODEL = dict(vocab_size=64, max_len=32, d_model=64, n_heads=2, n_layers=2)


def warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (SCHEDULE - WARMUP))))


def markov_batches(n_steps: int, batch_size: int, seq_len: int, vocab_size: int, seed: int,
                   branching: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Text from a fixed random Markov chain: each token is followed by one of ``branching`` tokens.

    The best achievable loss is ln(branching) nats; a model gets most of the way there in tens of steps.
    """
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
    batches = []
    for _ in range(n_steps):
        seq = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=g)
        choice = torch.randint(0, branching, (batch_size, seq_len), generator=g)
        for t in range(seq_len):
            seq[:, t + 1] = successors[seq[:, t], choice[:, t]]
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return batches


def build(precision: str, qk_norm: bool = False, steps: int = STEPS) -> dict:
    """The proxy run: model, AdamW, warmup-cosine, clipping at 1.0, copy-task batches."""
    torch.manual_seed(SEED)
    model = TinyTransformer(TransformerConfig(**MODEL, qk_norm=qk_norm))
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    batches = markov_batches(steps, batch_size=16, seq_len=MODEL["max_len"],
                                vocab_size=MODEL["vocab_size"], seed=SEED)
    return {"model": model, "loss_fn": lm_loss, "batches": batches, "optimizer": optimizer,
            "scheduler": scheduler, "max_grad_norm": 1.0, "precision": precision,
            "grad_scaler": precision == "fp16"}


def target():
    """bf16 autocast: the slow divergence (every value finite)."""
    return build("bf16")


def target_fp16():
    """fp16 autocast + GradScaler: NaN after tens of steps of logit growth."""
    return build("fp16")


if __name__ == "__main__":
    import sys

    from plain_loop import train

    args = sys.argv[1:]
    train(target_fp16() if "fp16" in args else build("fp32") if "fp32" in args else target(), steps=STEPS)
