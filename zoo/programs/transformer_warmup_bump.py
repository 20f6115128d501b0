"""pytorch/examples word_language_model ``TransformerModel`` (character level) trained with Adam and the Noam warm-up schedule.

Source: https://github.com/pytorch/examples, word_language_model/model.py and word_language_model/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: Wikitext-2 (a download) is replaced by the zoo's char_corpus() at character level; emsize 200 -> 64,
nhid 200 -> 128, nlayers 2, nhead 2, dropout 0.1; bptt 35 -> 32, batch 32 of random windows; main.py's
plain SGD is replaced by Adam(betas 0.9/0.98, eps 1e-9) with the "Attention is all you need" (Noam) schedule
lr = FACTOR * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), FACTOR 2.5, warmup 60
(peak lr 0.040 at step 59); 500 steps.
Kind: healthy. The loss falls to a level of 1.84 by step 49, then, as the warm-up reaches its peak lr 0.040,
bumps up to 1.98 (step 83) and stays above 1.84 until step 157; the decaying lr then lets it fall to a final
level 1.19 (noise sigma 0.036). Held-out NLL per character 3.27 -> 0.91.
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

STEPS = 500
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None,
         "how": "measured (zoo/truth/transformer_warmup_bump.log): the loss level (running median of 10) falls 3.30 "
                "-> 1.84 at step 49, bumps up 7% to 1.98 at step 83 as the Noam warm-up peaks (lr 0.040 at step "
                "59), is back below 1.84 at step 157 and ends at 1.19 (best 1.16); held-out NLL per character "
                "3.27 -> 0.91. Finite throughout."}

EMSIZE, NHEAD, NHID, NLAYERS, DROPOUT = 64, 2, 128, 2, 0.1
BPTT, BATCH_SIZE = 32, 32
FACTOR, WARMUP = 2.5, 60


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


def noam(step):
    step = step + 1
    return FACTOR * EMSIZE ** -0.5 * min(step ** -0.5, step * WARMUP ** -1.5)


def target(config=None):
    torch.manual_seed(1111)
    model = TransformerModel(NTOKENS, EMSIZE, NHEAD, NHID, NLAYERS, DROPOUT)
    g = torch.Generator().manual_seed(1111)
    high = len(TRAIN_IDS) - BPTT - 1

    def batches(step):
        return _windows(TRAIN_IDS, torch.randint(0, high, (BATCH_SIZE,), generator=g).tolist())

    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, noam)
    return {"model": model, "loss_fn": loss_fn, "batches": batches, "optimizer": opt, "scheduler": sched}


def measure(model, step):
    """The schedule's lr for this step (the Noam ramp and decay)."""
    return {"noam_lr": noam(step)}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
