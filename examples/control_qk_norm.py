"""Healthy: the attention-logit-growth proxy with qk-layernorm, at the same high learning rate.

Exactly the model, data and recipe of ``attention_logit_growth.py`` (2 pre-LN
blocks, AdamW with beta2 0.95 and eps 1e-8, clipping at 1.0, warmup then
cosine, peak LR 0.15) with one switch flipped: ``TransformerConfig(qk_norm=True)``
puts a LayerNorm on q and on k (per head) before ``q @ k^T``. The pre-softmax
logits are then bounded by ``|gamma_q| |gamma_k| sqrt(d)`` instead of growing
with every Adam step: they stay below ~10, the attention entropy stays away
from 0 and the loss trains down to ~1.7 and stays there, in bf16 and in fp16
with a GradScaler. This is the cure Wortsman et al. (arXiv 2309.14322) and
Dehghani et al. (ViT-22B) report for attention-logit growth.

A precursor monitor must stay silent here: the learning rate, the optimizer and
the data are the ones that fail without qk-layernorm.

Expected diagnosis: healthy - no finding, no early warning, exit code 0
(``target()`` in bf16, ``target_fp16()`` in fp16 + GradScaler).
"""

from __future__ import annotations

try:  # imported as part of a package (``examples.control_qk_norm``)
    from .attention_logit_growth import STEPS, build
except ImportError:  # run as a script or loaded from its path
    from attention_logit_growth import STEPS, build


def target():
    """bf16 autocast, qk-layernorm on."""
    return build("bf16", qk_norm=True)


def target_fp16():
    """fp16 autocast + GradScaler, qk-layernorm on."""
    return build("fp16", qk_norm=True)


if __name__ == "__main__":
    import sys

    from plain_loop import train

    train(target_fp16() if "fp16" in sys.argv[1:] else target(), steps=STEPS)
