"""pytorch/examples MNIST ``Net`` trained with OneCycleLR at max_lr 1.0 (the example's ``--lr`` default).

Source: https://github.com/pytorch/examples, mnist/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8,
license BSD-3-Clause.
Changed: MNIST (a download) is replaced by scikit-learn's bundled 8x8 digits, upsampled to 28x28 and
normalised with the example's (0.1307, 0.3081); the example's Adadelta + StepLR is replaced by SGD
(momentum 0.9) + OneCycleLR(max_lr=--lr) as users of the example commonly do; 120 steps of batch 64.
Kind: trajectory. The LR ramps to 1.0 over the first 30% of the run; the loss breaks away on the ramp
and the run goes non-finite before the peak: fc2's weight norm grows 1.86 -> 8.5 over steps 5-15
(applied LR 0.09 -> 0.41), the loss passes 3.6 at step 15 and hundreds by steps 17-19 (LR 0.50-0.58),
and the run is non-finite at step 21-22 (the last steps vary slightly between runs on CPU).
A lower max_lr, or clipping, holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 120
KIND = "trajectory"
FIXES = {"lr": "OneCycleLR max_lr 0.1 instead of 1.0", "clip": "clip_grad_norm_(model.parameters(), 1.0)"}
TRUTH = {"cause": "lr_spike", "mechanism": "lr_schedule", "module": None, "onset": [8, 15],
         "how": "measure()'s fc2_weight_norm sits at 1.86 over steps 0-5 (applied LR 0.04-0.09), passes 1.4x "
                "(2.69) at step 8 (LR 0.16) and 4.5x (8.48) at step 15 (LR 0.41) as the OneCycle ramp climbs; "
                "the loss then passes 3.6 at step 15, reaches hundreds by steps 17-19 and is non-finite at step 21-22 "
                "(zoo/truth/mnist_onecycle_lr1.log)"}


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


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(1)
    x, y = digits(size=28)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(1))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    max_lr = 0.1 if fix == "lr" else 1.0
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=STEPS)
    return {"model": model, "loss_fn": loss_fn, "batches": loader, "epochs": 10, "optimizer": opt,
            "scheduler": sched, "max_grad_norm": 1.0 if fix == "clip" else None}


def measure(model, step):
    """Truth-side precursors: fc2's weight norm (the logits' scale)."""
    return {"fc2_weight_norm": float(model.fc2.weight.norm())}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
