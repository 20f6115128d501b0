"""transformers' GPT2LMHeadModel (tiny GPT2Config, sdpa attention) trained with the HF Trainer recipe by hand at peak LR 0.3.

Source: https://github.com/huggingface/transformers, src/transformers/models/gpt2/modeling_gpt2.py, commit c44b2d9976e8eafbdcb89cb2710141b2bc9b138f, license Apache-2.0.
Changed: the model is the installed transformers' GPT2LMHeadModel built from GPT2Config(n_layer 2, n_head 4,
n_embd 64, n_positions 64, vocab = the characters of zoo/_data.char_corpus, dropout 0), no pretrained weights;
the Trainer's optimizer and schedule are set up by hand (AdamW betas 0.9/0.999, eps 1e-8, weight_decay 0,
get_linear_schedule_with_warmup with warmup_ratio 0.4), max_grad_norm off, learning_rate 0.3 (too high); fp32;
batch 16 x 64 characters, 250 steps.
Kind: trajectory. The LR ramps to 0.3 over 100 steps, then decays linearly. Layer 0's
largest attention logit |q.k|/sqrt(d) (a forward hook on c_attn's output) grows from 0.15 to 2.8e3 by the
loss's best level (2.61, step 48), to 2.8e4 by step 70 and to 1e6 by step 120 (one-hot attention); the loss
spikes to 7.2 at step 127 and settles at 2.73, stuck there (held-out 3.31 -> 2.71). learning_rate 1e-3 holds (held-out 1.66,
its largest attention logit 6.1); max_grad_norm 1.0 only just passes the hold test (final level 2.61, held-
out 2.59) while its attention logits still reach 1.4e6.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import char_corpus  # noqa: E402

STEPS = 250
KIND = "trajectory"
FIXES = {"lr": "learning_rate 1e-3 instead of 0.3",
         "clip": "max_grad_norm 1.0 (the Trainer's default): clip_grad_norm_(model.parameters(), 1.0)"}
TRUTH = {"cause": "lr_spike", "mechanism": "attention_logit_growth", "module": "transformer.h.0.attn",
         "onset": [53, 70],
         "how": "measure()'s h0_max_qk (largest |q.k|/sqrt(d_head) in transformer.h.0.attn on a fixed "
                "held-out batch, computed from c_attn's output by a forward hook) is already far above the "
                "lr-1e-3 run's maximum (6.1) from step 9 on, while the loss still improves; at the loss's best "
                "level (2.61, step 48) it is 2.8e3, it doubles by step 53 (5.7e3) and passes 10x by step 70 "
                "(2.8e4, applied LR 0.21) as the loss level leaves 2.61 for ~2.7; it reaches 1e6 by step 120, "
                "when the loss jumps to 5-7 (zoo/truth/hf_gpt2_high_lr.log)"}

LR, WARMUP_RATIO, BATCH, BLOCK = 0.3, 0.4, 16, 64


def data():
    text = char_corpus(60000)
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.long), len(chars)


def _qk_hook(stats, name, n_head):
    def hook(module, inp, out):
        with torch.no_grad():
            B, T, C3 = out.shape
            C = C3 // 3
            q, k, _ = out.split(C, dim=2)
            q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
            k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // n_head)
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            stats[name] = float(att.masked_fill(~mask, 0).abs().max())
    return hook


def target(config=None):
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup
    fix = (config or {}).get("fix")
    torch.manual_seed(42)
    ids, vocab = data()
    n_val = len(ids) // 10
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    cfg = GPT2Config(vocab_size=vocab, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(cfg)
    model.qk_stats = {}
    for i, blk in enumerate(model.transformer.h):
        blk.attn.c_attn.register_forward_hook(_qk_hook(model.qk_stats, f"h{i}_max_qk", cfg.n_head))
    g = torch.Generator().manual_seed(7)
    ix = torch.randint(len(val_ids) - BLOCK, (32,), generator=g)
    model.val_batch = torch.stack([val_ids[i:i + BLOCK] for i in ix])

    def batches(step):
        g = torch.Generator().manual_seed(step)
        ix = torch.randint(len(train_ids) - BLOCK, (BATCH,), generator=g)
        return {"input_ids": torch.stack([train_ids[i:i + BLOCK] for i in ix])}

    def loss_fn(model, batch):  # Trainer.compute_loss: outputs.loss with labels = input_ids (shifted inside)
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if fix == "lr" else LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, int(WARMUP_RATIO * STEPS), STEPS)
    return {"model": model, "batches": batches, "loss_fn": loss_fn, "optimizer": opt, "scheduler": sched,
            "max_grad_norm": 1.0 if fix == "clip" else None}


def measure(model, step):
    """Truth-side precursors: per layer, the largest |q.k|/sqrt(d_head) (from c_attn's output, via a forward
    hook) on a fixed held-out batch, and the held-out loss."""
    model.eval()
    loss = model(input_ids=model.val_batch, labels=model.val_batch).loss
    model.train()
    return {"val_loss": float(loss), **model.qk_stats}


def evaluate(model):
    """Held-out loss on a fixed batch of the last 10% of the text."""
    model.eval()
    with torch.no_grad():
        v = float(model(input_ids=model.val_batch, labels=model.val_batch).loss)
    model.train()
    return v


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
