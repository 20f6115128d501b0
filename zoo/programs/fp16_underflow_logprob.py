"""pytorch/examples' MNIST ``Net`` trained in fp16 with log(softmax(x)) instead of log_softmax (NVIDIA/apex issue 379).

Source: https://github.com/pytorch/examples, mnist/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: MNIST (a download) is replaced by scikit-learn's bundled 8x8 digits, so the conv stack is shrunk to
8x8 inputs (conv 16/32 channels, fc1 128 wide); Net returns fc2's logits and the loss is
F.nll_loss(torch.log(F.softmax(output, dim=1)), target) as in the apex report ("we use softmax->log->nll_loss
instead of nn.CrossEntropyLoss"), run under fp16 autocast; the example's Adadelta(lr=1.0) + StepLR(gamma=0.7) are kept; batch 64.
Kind: broken. Under fp16 the softmax output is rounded to half precision: once a logit sits more than ~17
below its row's largest logit its probability is below fp16's smallest subnormal
(6e-8) and rounds to exactly 0 and torch.log gives -inf. The first exact 0 is a non-target class at step 51
(that batch's largest logit spread is 18.0): nll_loss only gathers the true class, so the loss stays finite
(0.52) but LogBackward's 0/0 makes every gradient NaN. The example's own F.log_softmax holds (final 0.25).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 300
KIND = "broken"
FIXES = {"log_softmax": "return F.log_softmax(x, dim=1) (the example's own code)",
         "bf16": "train in bf16 autocast instead of fp16 (same exponent range as fp32)"}
TRUTH = {"cause": "underflow", "mechanism": None, "module": "(loss_fn)", "onset": None,
         "how": ('Public report: https://github.com/NVIDIA/apex/issues/379 (softmax -> log -> nll_loss instead of '
                 'CrossEntropyLoss: the log causes floating point underflow / overflow under fp16). Op: F.softmax '
                 "under fp16 autocast rounds a probability below fp16's smallest subnormal (6e-8) to exactly 0; "
                 'counted directly on the training batches: 0 zeros at steps 46-50 (largest logit spread 14.4-16.1), 1 '
                 'zero at step 51 (spread 18.0); torch.log gives -inf there. nll_loss gathers only the true class, so '
                 "the step-51 loss stays finite (0.518) but LogBackward (0/0) makes the gradients NaN. (measure's "
                 'max_logit_spread is eval-mode fp32 over the training set: 12.7 at step 50; dropout in train mode '
                 'widens the batch spread.)')}


class Net(nn.Module):
    def __init__(self, use_log_softmax=False):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, 10)
        self.use_log_softmax = use_log_softmax

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return x


def loss_fn(model, batch):
    data, target = batch
    output = model(data)
    if model.use_log_softmax:
        return F.nll_loss(F.log_softmax(output, dim=1), target)
    return F.nll_loss(torch.log(F.softmax(output, dim=1)), target)   # softmax -> log -> nll_loss (apex 379)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(1)
    x, y = digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:1500], y[:1500]), batch_size=64,
                                         shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1))
    model = Net(use_log_softmax=fix == "log_softmax")
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=23, gamma=0.7)   # the example steps it once per epoch (23 batches)
    return {"model": model, "loss_fn": loss_fn, "batches": loader, "epochs": 20, "optimizer": optimizer,
            "scheduler": scheduler, "precision": "bf16" if fix == "bf16" else "fp16"}


def measure(model, step):
    """Largest spread (row max logit - row min logit) on the training set, in fp32: over ~16.6 underflows fp16."""
    x, y = digits()
    was = model.training
    model.eval()
    h = model.fc2(F.relu(model.fc1(torch.flatten(F.max_pool2d(F.relu(model.conv2(F.relu(model.conv1(x[:1500])))), 2), 1))))
    model.train(was)
    gap = h.max(1).values - h.min(1).values
    return {"max_logit_spread": float(gap.max())}


def evaluate(model):
    x, y = digits()
    model.eval()
    with torch.no_grad():
        h = model.fc2(F.relu(model.fc1(torch.flatten(F.max_pool2d(F.relu(model.conv2(F.relu(model.conv1(x[1500:])))), 2), 1))))
        out = float(F.cross_entropy(h, y[1500:]))
    model.train()
    return out


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
