"""pytorch/examples word_language_model: a 2-layer LSTM ``RNNModel`` with main.py's hand-written SGD (lr 20, clip 0.25).

Source: https://github.com/pytorch/examples, word_language_model/model.py and word_language_model/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: Wikitext-2 (a download) is replaced by the zoo's char_corpus() split into words (train/valid 90/10);
emsize/nhid 200 -> 100, batch_size 20 kept, bptt 35 -> 12, dropout 0.2 kept; 600 steps of
main.py's update (model.zero_grad, backward, clip_grad_norm_(0.25), p.data.add_(p.grad, alpha=-lr) with
lr 20) with the hidden state carried and repackaged across steps (truncated BPTT); the /4 annealing is kept.
Kind: healthy. The loss first rises 3.78 -> 4.06 (step 3) and sits on a noisy plateau (3.3-4.06) for ~70 steps
while the clipped lr-20 steps bounce, then drops to ~1.6 and keeps falling slowly (final level 1.58) with step-to-step
noise ~0.03; the lr is annealed 20 -> 5 (step 396) -> 1.25 (step 528). Held-out NLL 3.78 -> 1.60.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import char_corpus  # noqa: E402

STEPS = 600
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None,
         "how": "measured (zoo/truth/word_lm_lstm_clip.log): the train loss rises from 3.78 to 4.06 (step 3) and "
                "plateaus noisily (3.3-4.06) for ~70 steps under the clipped lr-20 SGD, then falls to a final level "
                "1.58 (best 1.57, noise sigma 0.034); lr annealed /4 at steps 396 and 528 when the valid loss stalled; "
                "held-out NLL per word 3.78 -> 1.60. Finite throughout."}

EMSIZE, NHID, NLAYERS, DROPOUT = 100, 100, 2, 0.2
LR, CLIP, BATCH_SIZE, BPTT, EVAL_BATCH_SIZE = 20.0, 0.25, 20, 12, 10


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
            if nhid != ninp:
                raise ValueError('When using the tied flag, nhid must be equal to emsize')
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
    return data.view(bsz, -1).t().contiguous()


def get_batch(source, i):
    seq_len = min(BPTT, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def _corpus():
    words = char_corpus(60000, seed=0).replace(".", " <eos>").split()
    vocab = sorted(set(words))
    idx = {w: i for i, w in enumerate(vocab)}
    ids = torch.tensor([idx[w] for w in words], dtype=torch.long)
    n = int(0.9 * len(ids))
    return len(vocab), ids[:n], ids[n:]


NTOKENS, TRAIN_IDS, VALID_IDS = _corpus()
VAL_DATA = batchify(VALID_IDS, EVAL_BATCH_SIZE)
criterion = nn.NLLLoss()


def _evaluate(model, data_source):
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(EVAL_BATCH_SIZE)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, BPTT):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    model.train()
    return total_loss / (len(data_source) - 1)


def evaluate(model) -> float:
    """Held-out (valid split) NLL per word, as main.py's evaluate(val_data)."""
    return _evaluate(model, VAL_DATA)


def target(config=None):
    torch.manual_seed(1111)
    train_data = batchify(TRAIN_IDS, BATCH_SIZE)
    starts = list(range(0, train_data.size(0) - 1, BPTT))
    model = RNNModel('LSTM', NTOKENS, EMSIZE, NHID, NLAYERS, DROPOUT)
    state = {"lr": LR, "hidden": None, "best_val": None}

    def batches(step):
        return get_batch(train_data, starts[step % len(starts)])

    def step_fn(model, batch, step):
        data, targets = batch
        if step % len(starts) == 0:  # a new epoch: main.py's train() starts from a fresh hidden state
            if step > 0:  # end of epoch: anneal lr /4 if valid loss did not improve (main.py)
                val_loss = _evaluate(model, VAL_DATA)
                if state["best_val"] is None or val_loss < state["best_val"]:
                    state["best_val"] = val_loss
                else:
                    state["lr"] /= 4.0
            state["hidden"] = model.init_hidden(BATCH_SIZE)
        model.zero_grad()
        hidden = repackage_hidden(state["hidden"])
        output, hidden = model(data, hidden)
        state["hidden"] = hidden
        loss = criterion(output, targets)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-state["lr"])
        return {"loss": loss, "grad_norm": gnorm, "lr": torch.tensor(state["lr"])}

    return {"model": model, "step_fn": step_fn, "batches": batches}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
