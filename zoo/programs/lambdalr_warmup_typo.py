"""pytorch/examples' MNIST LSTM classifier (mnist_rnn) with a LambdaLR warm-up whose lambda forgets to divide.

Source: https://github.com/pytorch/examples, mnist_rnn/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: MNIST (a download) is replaced by scikit-learn's bundled 8x8 digits (8 rows of 8 pixels as the
sequence, so LSTM input_size 8); the example's Adadelta + StepLR is replaced by SGD (lr 0.05, momentum 0.9)
with a LambdaLR linear warm-up over 100 steps, written with the common slip ``lambda step: step if step <
warmup else 1.0`` (a factor of ``step`` instead of ``step / warmup``); batch 64.
Kind: broken. The LR is 0.05 x step, so it passes the intended peak 0.05 at step 1 and keeps growing by 0.05
per step; at lr 2.15 (step 43) the loss leaves its 2.3-2.5 band, then 25.6, 4.3e3, ... 1.1e24 at step 48 and
NaN at step 49. Dividing by the warm-up length holds (final 0.51); clipping the gradient norm keeps the run
finite but the LR keeps growing and it stops learning (final level 2.30).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 200
KIND = "broken"
WARMUP = 100
FIXES = {"divide": "lr_lambda = lambda step: step / warmup if step < warmup else 1.0 (the intended warm-up)",
         "clip": "clip_grad_norm_(model.parameters(), 1.0), LambdaLR unchanged"}
TRUTH = {"cause": "lr_spike", "mechanism": None, "module": None, "onset": None,
         "how": ('Public report: '
                 'https://runebook.dev/en/docs/pytorch/generated/torch.optim.lr_scheduler.lambdalr/torch.optim.lr_scheduler.LambdaLR '
                 '(LambdaLR pitfalls: lr_lambda must return a multiplicative factor, not a value on another scale). '
                 "Op: the scheduler's factor is step instead of step / 100, so lr = 0.05 * step (1.45 at step 29, 2.15 "
                 'at step 43); the loss sits at 2.3-2.5 until step 42, then 5.2 at step 43, 25.6, 4.3e3, 2.3e5, '
                 '5.9e11, 1.1e24 at step 48 (fc2 weight norm 60 -> 1.9e16) and NaN at step 49.')}


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.rnn = nn.LSTM(input_size=8, hidden_size=64, batch_first=True)
        self.batchnorm = nn.BatchNorm1d(64)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, input):
        input = input.reshape(-1, 8, 8)
        output, hidden = self.rnn(input)
        output = output[:, -1, :]
        output = self.batchnorm(output)
        output = self.dropout1(output)
        output = self.fc1(output)
        output = F.relu(output)
        output = self.dropout2(output)
        output = self.fc2(output)
        output = F.log_softmax(output, dim=1)
        return output


def loss_fn(model, batch):
    data, target = batch
    return F.nll_loss(model(data), target)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(1)
    x, y = digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:1500], y[:1500]), batch_size=64,
                                         shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1))
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if fix == "divide":
        lr_lambda = lambda step: step / WARMUP if step < WARMUP else 1.0  # noqa: E731
    else:
        lr_lambda = lambda step: step if step < WARMUP else 1.0  # noqa: E731  (the slip)
    scheduler = optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return {"model": model, "loss_fn": loss_fn, "batches": loader, "epochs": 20, "optimizer": optimizer,
            "scheduler": scheduler, "max_grad_norm": 1.0 if fix == "clip" else None}


def evaluate(model):
    x, y = digits()
    model.eval()
    with torch.no_grad():
        out = float(F.nll_loss(model(x[1500:]), y[1500:]))
    model.train()
    return out


def measure(model, step):
    return {"fc2_weight_norm": float(model.fc2.weight.norm())}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
