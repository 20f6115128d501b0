"""pytorch/examples word_language_model ``TransformerModel`` with the Noam schedule's factor set to 8 where the recipe has 2.5.

Source: https://github.com/pytorch/examples, word_language_model/model.py and word_language_model/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: as zoo/programs/transformer_warmup_bump.py (the same program: Wikitext-2 replaced by the zoo's
char_corpus() at character level, emsize 64, nhid 128, 2 layers, 2 heads, Adam(0.9, 0.98, eps 1e-9) with the
Noam schedule lr = FACTOR * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), warmup 60) with FACTOR 8 where
the recipe has 2.5 (peak lr 0.13 instead of 0.040); 300 steps.
Kind: trajectory. The loss falls to a level of 2.19 by step 24 (lr 0.054 on the ramp), leaves it from step
27-30 as the ramp climbs past 0.06 (level 2.24 at 30, 2.48 at 36, lr 0.080) and sticks at 2.70-2.73 (the
character unigram level) for the rest of the run. The recipe's factor holds (final level 1.47); clipping at
main.py's 0.25 and a 4x longer warm-up only delay it (final levels 2.75).
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
FIXES = {"factor": "the Noam factor 2.5 the recipe uses (peak lr 0.040 instead of 0.13)",
         "clip": "torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25) (main.py's --clip default)",
         "warmup": "warm-up over 240 steps instead of 60 (same factor)"}
TRUTH = {"cause": "lr_spike", "mechanism": "lr_schedule", "module": None, "onset": [26, 36],
         "how": "measured (zoo/truth/transformer_noam_factor_typo.log): the loss level (running median of 10) "
                "falls 3.30 -> 2.194 at step 24 while the Noam ramp climbs (noam_lr 0.054 at step 24), leaves it at "
                "steps 27-36 (2.205 at 27, 2.243 at 30, 2.484 at 36; lr 0.060 -> 0.080) and stays at 2.70-2.73 "
                "for the rest of the run: the schedule's ramp took the LR past what the model tolerates"}

EMSIZE, NHEAD, NHID, NLAYERS, DROPOUT = 64, 2, 128, 2, 0.1
BPTT, BATCH_SIZE = 32, 32
FACTOR, WARMUP = 8.0, 60   # the recipe's factor is 2.5 (zoo/programs/transformer_warmup_bump.py)


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

    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.5):
        super(TransformerModel, self).__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid,
                                               num_encoder_layers=nlayers)
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


def evaluate(model) -> float:
    """Held-out NLL per character on the valid split (main.py's evaluate)."""
    model.eval()
    starts = list(range(0, len(VALID_IDS) - BPTT - 1, BPTT))
    with torch.no_grad():
        loss = loss_fn(model, _windows(VALID_IDS, starts)).item()
    model.train()
    return loss


def noam(step, factor=None, warmup=None):
    step = step + 1
    factor, warmup = factor or FACTOR, warmup or WARMUP
    return factor * EMSIZE ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(1111)
    model = TransformerModel(NTOKENS, EMSIZE, NHEAD, NHID, NLAYERS, DROPOUT)
    g = torch.Generator().manual_seed(1111)
    high = len(TRAIN_IDS) - BPTT - 1

    def batches(step):
        return _windows(TRAIN_IDS, torch.randint(0, high, (BATCH_SIZE,), generator=g).tolist())

    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: noam(s, factor=2.5 if fix == "factor" else None,
                                                                  warmup=240 if fix == "warmup" else None))
    return {"model": model, "loss_fn": loss_fn, "batches": batches, "optimizer": opt, "scheduler": sched,
            "max_grad_norm": 0.25 if fix == "clip" else None}


def measure(model, step):
    """The schedule's lr for this step (the Noam ramp and decay)."""
    return {"noam_lr": noam(step)}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
