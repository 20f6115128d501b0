"""pytorch/examples MNIST ``Net`` trained with OneCycleLR at max_lr 0.1 (a tenth of the example's --lr default).

Source: https://github.com/pytorch/examples, mnist/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: MNIST (a download) is replaced by scikit-learn's bundled 8x8 digits, upsampled to 28x28 and
normalised with the example's (0.1307, 0.3081), 1497 train / 300 held out; Net is the example's unchanged;
the example's Adadelta + StepLR is replaced by SGD (momentum 0.9) + OneCycleLR(max_lr=0.1) as users of the
example commonly do; 200 steps of batch 64 (about 8.5 epochs). Sibling of mnist_onecycle_lr1.py (max_lr 1.0).
Kind: healthy. While the OneCycle LR ramps to its 0.1 peak (step 60) the train loss stalls at a level of
~1.0 (0.999 at step 39 -> 1.04 at steps 45-50) and the held-out confidence dips (mean max-prob 0.93 at step
40 -> 0.47 at step 44), with single-batch spikes later (0.44 above the level at step 133, 4x the per-step
sigma of 0.12); as the LR anneals the level falls to 0.099 and the head is confident (fc2 weight norm
1.86 -> 7.1, mean max-prob 0.975). Held-out NLL 2.30 -> 0.117.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 200
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None, "how": ("loss level stalls and bumps 0.999 -> 1.04 (steps 39-50) and held-out confidence dips 0.93 -> 0.47 "
                "as OneCycle's LR peaks at 0.1 (step 60); single-batch spikes up to +0.43 over the level later; "
                "then final level 0.099, fc2 weight norm 1.86 -> 7.1, mean max-prob 0.975; held-out NLL "
                "2.30 -> 0.117; finite throughout")}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

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
        return F.log_softmax(x, dim=1)


def loss_fn(model, batch):
    data, target = batch
    return F.nll_loss(model(data), target)


def _split():
    x, y = digits(size=28)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return (x[perm[300:]], y[perm[300:]]), (x[perm[:300]], y[perm[:300]])


def target(config=None):
    torch.manual_seed(1)
    (x, y), _ = _split()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(1))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
    return {"model": model, "loss_fn": loss_fn, "batches": loader, "epochs": 20, "optimizer": opt,
            "scheduler": sched}


def measure(model, step):
    """fc2's weight norm (the logits' scale) and the mean max-probability on 100 held-out digits (eval mode)."""
    _, (x, _) = _split()
    was = model.training
    model.eval()
    logp = model(x[:100])
    model.train(was)
    return {"fc2_weight_norm": float(model.fc2.weight.norm()), "mean_conf": float(logp.exp().max(-1).values.mean())}


def evaluate(model):
    """Held-out NLL on the 300 held-out digits (eval mode)."""
    _, (x, y) = _split()
    model.eval()
    with torch.no_grad():
        v = float(F.nll_loss(model(x), y))
    model.train()
    return v


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
