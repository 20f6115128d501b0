"""pytorch/examples' word_language_model (LSTM RNNModel, hand-written SGD update) run at its default lr 20 without clipping.

Source: https://github.com/pytorch/examples, word_language_model/model.py + main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: Wikitext-2 (a download) is replaced by the zoo's char corpus split into words (vocabulary of 35);
--model RNN_RELU (one of the example's documented --model choices), emsize/nhid 64, 2 layers, dropout 0.2,
bptt 35, batch 20; main.py's train() is kept as the step_fn
(repackage_hidden, model.zero_grad, backward, p.data.add_(p.grad, alpha=-lr)) with the default lr 20, but
without its clip_grad_norm_(model.parameters(), args.clip) line (as when a user drops --clip or sets it
huge).
Kind: broken. The hand-written update p -= 20 * grad on an unclipped ReLU RNN explodes at once: loss 3.81,
8.58, 1803 (gradient norm 0.30 -> 15 -> 1.5e5, decoder weight norm 4 -> 79 -> 3.7e4) and NaN at step 3.
Restoring the example's clip_grad_norm_(..., 0.25) holds (held-out NLL 3.81 -> 3.41); lr 1 without
clipping only delays it (NaN at step 119).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import char_corpus  # noqa: E402

STEPS = 200
KIND = "broken"
FIXES = {"clip": "keep main.py's clip_grad_norm_(model.parameters(), 0.25) (the example's default --clip)",
         "lr": "lr 1 instead of 20, still unclipped"}
TRUTH = {"cause": "lr_spike", "mechanism": None, "module": None, "onset": None,
         "how": ("Public report: https://github.com/pytorch/examples/pull/223 ('running RNN_RELU with default "
                 "arguments produces nan losses immediately'; the default lr 20 is 'border-line fastest'). Op: "
                 "main.py's hand-written SGD update p.data.add_(p.grad, alpha=-lr) with lr 20 and no "
                 "clip_grad_norm_: measure's grad_norm 0.30 -> 15.1 -> 1.45e5 and decoder_weight_norm 4.0 -> "
                 "78.8 -> 3.7e4 over steps 0-2 (loss 3.81, 8.58, 1803), and the step-3 forward overflows to "
                 "NaN. The LR is constant; the update it scales is what explodes.")}


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super(RNNModel, self).__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ['LSTM', 'GRU']:
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            nonlinearity = {'RNN_TANH': 'tanh', 'RNN_RELU': 'relu'}[rnn_type]
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
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
        if self.rnn_type == 'LSTM':
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        else:
            return weight.new_zeros(self.nlayers, bsz, self.nhid)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    else:
        return tuple(repackage_hidden(v) for v in h)


BPTT, BATCH = 35, 20


def corpus():
    words = char_corpus(120000, seed=0).replace(".", " <eos>").split()
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    ids = torch.tensor([vocab[w] for w in words])
    return ids, len(vocab)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(1111)
    ids, ntokens = corpus()
    train_data = batchify(ids[: int(0.9 * len(ids))], BATCH)
    target.val_data = batchify(ids[int(0.9 * len(ids)):], 10)
    model = RNNModel("RNN_RELU", ntokens, 64, 64, 2, 0.2)
    criterion = nn.NLLLoss()
    lr = 1.0 if fix == "lr" else 20.0
    clip = 0.25 if fix == "clip" else None
    n_batches = (train_data.size(0) - 1) // BPTT
    state = {"hidden": model.init_hidden(BATCH)}

    def get_batch(source, i):
        seq_len = min(BPTT, len(source) - 1 - i)
        data = source[i:i + seq_len]
        target = source[i + 1:i + 1 + seq_len].view(-1)
        return data, target

    def batches(step):
        return get_batch(train_data, (step % n_batches) * BPTT)

    def step_fn(model, batch, step):
        model.train()
        if step % n_batches == 0:
            state["hidden"] = model.init_hidden(BATCH)
        data, targets = batch
        model.zero_grad()
        hidden = repackage_hidden(state["hidden"])
        output, hidden = model(data, hidden)
        state["hidden"] = hidden
        loss = criterion(output, targets)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        return loss.detach()

    return {"model": model, "step_fn": step_fn, "batches": batches}


def measure(model, step):
    grads = [p.grad.norm() for p in model.parameters() if p.grad is not None]
    return {"grad_norm": float(torch.stack(grads).norm()) if grads else 0.0,
            "decoder_weight_norm": float(model.decoder.weight.norm())}


def evaluate(model):
    model.eval()
    val = target.val_data
    hidden = model.init_hidden(10)
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, val.size(0) - 1, BPTT):
            seq_len = min(BPTT, len(val) - 1 - i)
            output, hidden = model(val[i:i + seq_len], hidden)
            total += seq_len * float(F.nll_loss(output, val[i + 1:i + 1 + seq_len].reshape(-1)))
            n += seq_len
    model.train()
    return total / n


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
