"""A GPT-2 (transformers) whose LayerNorm receives a 1e38 embedding row: the variance overflows.

A small GPT-2 is trained on a toy corpus. Its token embedding came from a
checkpoint converter that fills rows of tokens the source vocabulary lacked
with a "never used" sentinel, 1e38 (close to float32's 3.4e38 maximum). The
first batch that holds such a token (id 3, at step 2) feeds the row to the
first block's ``ln_1``: LayerNorm squares its inputs to get the variance,
(1e38)^2 is far beyond float32's range, the variance is inf, 1/sqrt(inf) = 0
and (x - mean) * 0 with x - mean = inf is NaN. That is an overflow of the
variance, not a division by zero, and a larger eps does not help: the row
itself is the bug.

Needs the ``transformers`` extra. Expected diagnosis: cause ``overflow``,
phase ``forward``, module ``transformer.h.0.ln_1``, step 2.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ_LEN, BATCH_SIZE, N_STEPS, SENTINEL_ID = 64, 12, 4, 6, 3


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=1, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():   # the converter's "never used" rows
        model.transformer.wte.weight[SENTINEL_ID] = 1e38
    return model


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(N_STEPS):
        ids = torch.randint(4, VOCAB, (BATCH_SIZE, SEQ_LEN), generator=g)
        if step == 2:
            ids[1, 5] = SENTINEL_ID   # the first batch with the sentinel token
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def lm_loss(model, batch) -> torch.Tensor:
    return model(**batch).loss


def target():
    model = make_model()
    return {"model": model, "loss_fn": lm_loss, "batches": make_batches(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}


if __name__ == "__main__":
    from plain_loop import train

    train(target())
