"""pytorch/examples word_language_model: a 2-layer LSTM LM trained with main.py's hand-written SGD at lr 20, --clip 0.

Source: https://github.com/pytorch/examples, word_language_model/main.py + model.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: Wikitext-2 (a download) is replaced by the words of zoo/_data.char_corpus (a small grammar, 44-word
vocabulary); emsize/nhid 200 -> 64, bptt 35 -> 20, batch 20, dropout 0.2; 300 steps; main.py's train() step
(model.zero_grad, repackage_hidden, NLLLoss on log_softmax, clip_grad_norm_(args.clip), p.data.add_(p.grad,
alpha=-lr)) is the step_fn, with --clip 0 (clipping off) instead of the default 0.25.
Kind: trajectory. Without clipping, the lr-20 SGD update throws the LSTM weights from
0.3 to 36 (largest |w|) at step 3; the decoder's largest |logit| on a held-out batch goes 5.2 -> 48 -> 250
over steps 0-3 and stays at 300-430, and the loss jumps 3.8 -> 16 -> 57 and stays at 65-200 for the whole
300 steps (held-out NLL 3.79 -> 117). --clip 0.25 (held-out 1.65) or lr 1 (2.51) holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import char_corpus  # noqa: E402

STEPS = 300
KIND = "trajectory"
FIXES = {"clip": "--clip 0.25 (the example's default): clip_grad_norm_(model.parameters(), 0.25)",
         "lr1": "--lr 1 instead of 20 (still no clipping)"}
TRUTH = {"cause": "lr_spike", "mechanism": "output_logit_divergence", "module": "decoder", "onset": [2, 3],
         "how": "the decoder is the output head: its logits are what grew (activation_growth of the same module "
                "is the same story told one level down). measure()'s max_logit (largest |decoder output| on a held-out batch) is 5.2 at step 0, passes "
                "9x (48) at step 2 and 48x (250) at step 3, where the unclipped gradient norm peaks at 15.6 "
                "and the LSTM's largest weight jumps 0.3 -> 36; the loss jumps 3.8 -> 16 at step 3 and never "
                "comes back below 38 (zoo/truth/word_lm_lstm_lr20_noclip.log)"}

BPTT, BSZ, LR = 20, 20, 20.0


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super(RNNModel, self).__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def corpus():
    words = char_corpus(60000).replace(".", " <eos>").split()
    vocab = sorted(set(words))
    ids = torch.tensor([vocab.index(w) for w in words], dtype=torch.long)
    return ids, len(vocab)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(1111)
    ids, ntokens = corpus()
    n_val = len(ids) // 10
    train_data, val_data = batchify(ids[:-n_val], BSZ), batchify(ids[-n_val:], 10)
    model = RNNModel("LSTM", ntokens, 64, 64, 2, dropout=0.2)
    model.val_data = val_data
    criterion = nn.NLLLoss()
    lr = 1.0 if fix == "lr1" else LR
    clip = 0.25 if fix == "clip" else 0.0
    nb = (train_data.size(0) - 1) // BPTT
    state = {"hidden": model.init_hidden(BSZ)}

    def batches(step):
        i = (step % nb) * BPTT
        seq_len = min(BPTT, len(train_data) - 1 - i)
        return train_data[i:i + seq_len], train_data[i + 1:i + 1 + seq_len].reshape(-1)

    def step_fn(model, batch, step):
        data, targets = batch
        if step % nb == 0:
            state["hidden"] = model.init_hidden(BSZ)
        model.train()
        model.zero_grad()
        hidden = repackage_hidden(state["hidden"])
        output, hidden = model(data, hidden)
        state["hidden"] = hidden
        loss = criterion(output, targets)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        return {"loss": loss, "grad_norm": gn}

    return {"model": model, "batches": batches, "step_fn": step_fn}


def measure(model, step):
    """Truth-side precursors: the largest |logit| of the decoder and the LSTM's largest weight."""
    was = model.training
    model.eval()
    data = model.val_data[:BPTT]
    out, _ = model.rnn(model.encoder(data), model.init_hidden(data.size(1)))
    logits = model.decoder(out)
    model.train(was)
    return {"max_logit": float(logits.abs().max()), "rnn_max_weight": max(float(p.abs().max()) for p in model.rnn.parameters())}


def evaluate(model):
    """Held-out NLL (main.py's evaluate())."""
    model.eval()
    data = model.val_data
    hidden = model.init_hidden(data.size(1))
    total = 0.0
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, BPTT):
            seq_len = min(BPTT, data.size(0) - 1 - i)
            out, hidden = model(data[i:i + seq_len], hidden)
            total += seq_len * float(F.nll_loss(out, data[i + 1:i + 1 + seq_len].reshape(-1)))
    model.train()
    return total / (data.size(0) - 1)


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
