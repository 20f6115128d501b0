"""pytorch/examples word_language_model ``TransformerModel`` (Post-LN, character level), AdamW, and a milestone schedule whose gamma multiplies the LR instead of dividing it.

Source: https://github.com/pytorch/examples, word_language_model/model.py and word_language_model/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: Wikitext-2 (a download) is replaced by the zoo's char_corpus() at character level; emsize 200 -> 64,
nhid 200 -> 128, nlayers 2, nhead 2, dropout 0.2 (main.py's default; here also passed to the encoder layers,
which model.py leaves at nn.Transformer's 0.1), a norm_first argument added for the Pre-LN fix; bptt 35 -> 32, batch 32 of random
windows; main.py's --use-optimizer AdamW (lr 3e-3, other defaults) with its --clip 0.25 switched off, and a
MultiStepLR(milestones=[150], gamma=8) meant as a decay (gamma 1/8) typed as 8; 300 steps.
Kind: trajectory. The Post-LN encoder learns well at 3e-3 (loss level 3.31 -> 1.33 at step 150, held-out NLL
0.94). The milestone multiplies the LR by 8 (0.024 from step 150): the loss jumps to 1.65, 2.09, 3.07 over
steps 151-153 and its level sits at 2.4 from step 158, only creeping to 2.0 by step 300 (held-out 3.27 ->
1.89 at the end, versus 0.94 before the jump). After the break, layer 0's largest attention logit grows from
10.3 to 109 (step 175), 2.2e3 (step 220) and 5.2e3 (step 299). Gamma 1 (held-out 0.65), Pre-LN (0.72) and
clipping at 0.25 (0.98, its layer-0 logits still reach 122) all hold.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import char_corpus  # noqa: E402

STEPS = 300
KIND = "trajectory"
FIXES = {"no_jump": "MultiStepLR gamma 1 (no LR change at the milestone): AdamW lr 3e-3 throughout",
         "preln": "norm_first=True (Pre-LN encoder layers), schedule unchanged",
         "clip": "main.py's default --clip 0.25: clip_grad_norm_(model.parameters(), 0.25), schedule unchanged"}
TRUTH = {"cause": "lr_spike", "mechanism": "lr_schedule", "module": None, "onset": [150, 155],
         "how": "measure()'s lr_applied is 0.003 until the MultiStepLR milestone and 0.024 (8x) for the optimizer "
                "steps from step 150 on; the loss level (median of 10) is at its best 1.33 at step 150, the loss "
                "goes 1.27 (step 150) -> 1.65 -> 2.09 -> 3.07 (step 153) and the level leaves 1.33 at step 155 "
                "(1.49) for 2.43 at step 159, ending at 2.00; held-out val_loss 0.94 (step 149) -> 2.9 (step 152) -> "
                "1.89 (step 299). The attention logits follow rather than lead: layer 0's largest |q.k|/sqrt(d_head) "
                "(l0_max_qk, from encoder.layers.0.self_attn's in_proj on the layer input, held-out windows) is "
                "10.3 at step 149, only 12.1 at step 152, passes 2x at 159, 10x (109) at 175 and reaches 5.2e3 by "
                "step 299 (zoo/truth/postln_transformer_lr_jump.log)"}

EMSIZE, NHEAD, NHID, NLAYERS, DROPOUT = 64, 2, 128, 2, 0.2
BPTT, BATCH_SIZE = 32, 32
LR = 3e-3
MILESTONE = 150
GAMMA = 8.0   # meant 1/8 (a decay), typed 8


class PositionalEncoding(nn.Module):
    r"""Inject some information about the relative or absolute position of the tokens in the sequence."""

    def __init__(self, d_model, dropout=0.1, max_len=5000):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer('pe', pe)

    def forward(self, x):
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


class TransformerModel(nn.Transformer):
    """Container module with an encoder, a recurrent or transformer module, and a decoder."""

    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.5, norm_first=False):
        super(TransformerModel, self).__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid,
                                               num_encoder_layers=nlayers, dropout=dropout, norm_first=norm_first)
        self.model_type = 'Transformer'
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        self.init_weights()

    def _generate_square_subsequent_mask(self, sz):
        return torch.log(torch.tril(torch.ones(sz, sz)))

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.input_emb.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src, has_mask=True):
        if has_mask:
            device = src.device
            if self.src_mask is None or self.src_mask.size(0) != len(src):
                mask = self._generate_square_subsequent_mask(len(src)).to(device)
                self.src_mask = mask
        else:
            self.src_mask = None
        src = self.input_emb(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.encoder(src, mask=self.src_mask)
        output = self.decoder(output)
        return F.log_softmax(output, dim=-1)


def _corpus():
    text = char_corpus(40000, seed=0)
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    n = int(0.9 * len(ids))
    return len(chars), ids[:n], ids[n:]


NTOKENS, TRAIN_IDS, VALID_IDS = _corpus()
criterion = nn.NLLLoss()


def _windows(ids, starts):
    data = torch.stack([ids[s:s + BPTT] for s in starts], 1)          # (bptt, batch), as main.py's batchify
    target = torch.stack([ids[s + 1:s + 1 + BPTT] for s in starts], 1).reshape(-1)
    return data, target


def loss_fn(model, batch):
    data, targets = batch
    output = model(data).view(-1, NTOKENS)
    return criterion(output, targets)


def _val_batch():
    starts = list(range(0, len(VALID_IDS) - BPTT - 1, BPTT))
    return _windows(VALID_IDS, starts)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(1111)
    model = TransformerModel(NTOKENS, EMSIZE, NHEAD, NHID, NLAYERS, DROPOUT, norm_first=fix == "preln")
    model.layer_in = {}
    for i, layer in enumerate(model.encoder.layers):   # keep each encoder layer's input (for q.k in measure)
        layer.register_forward_pre_hook(lambda mod, args, i=i: model.layer_in.__setitem__(i, args[0].detach()))
    g = torch.Generator().manual_seed(1111)
    high = len(TRAIN_IDS) - BPTT - 1

    def batches(step):
        return _windows(TRAIN_IDS, torch.randint(0, high, (BATCH_SIZE,), generator=g).tolist())

    opt = torch.optim.AdamW(model.parameters(), lr=LR)          # main.py --use-optimizer
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[MILESTONE], gamma=1.0 if fix == "no_jump" else GAMMA)
    model.opt_ref = opt
    return {"model": model, "loss_fn": loss_fn, "batches": batches, "optimizer": opt, "scheduler": sched,
            "max_grad_norm": 0.25 if fix == "clip" else None}


def _max_logit(layer, x):
    """Largest causal |q.k|/sqrt(d_head) of an encoder layer's self-attention on its input x (T, B, E)."""
    attn = layer.self_attn
    if layer.norm_first:
        x = layer.norm1(x)
    E = x.shape[-1]
    w, b = attn.in_proj_weight, attn.in_proj_bias
    q = F.linear(x, w[:E], b[:E])
    k = F.linear(x, w[E:2 * E], b[E:2 * E])
    T, B, _ = q.shape
    h, d = attn.num_heads, E // attn.num_heads
    q = q.reshape(T, B, h, d).permute(1, 2, 0, 3)
    k = k.reshape(T, B, h, d).permute(1, 2, 0, 3)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    return float(att.masked_fill(~mask, 0).abs().max())


def measure(model, step):
    """Truth-side precursors: held-out NLL, the applied LR, and per encoder layer the largest attention logit
    |q.k|/sqrt(d_head) on the held-out windows (q, k from self_attn's in_proj on the layer's input)."""
    model.eval()
    data, targets = _val_batch()
    v = float(criterion(model(data).view(-1, NTOKENS), targets))
    out = {"val_loss": v, "lr_applied": model.opt_ref.param_groups[0]["lr"]}
    for i, layer in enumerate(model.encoder.layers):
        out[f"l{i}_max_qk"] = _max_logit(layer, model.layer_in[i])
    model.train()
    return out


def evaluate(model) -> float:
    """Held-out NLL per character on the valid split (main.py's evaluate)."""
    model.eval()
    with torch.no_grad():
        loss = loss_fn(model, _val_batch()).item()
    model.train()
    return loss


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
