"""Divergence inside a noisy run: a MultiStepLR milestone that multiplies by 100.

The delivery-time regression of ``control_heavy_tailed_loss.py`` (targets
with Pareto-tailed delays: batch losses jump 10x-100x and recover all the
time) is trained with SGD + momentum and a step decay at step 30, typed as
``MultiStepLR(milestones=[30], gamma=100)`` instead of ``gamma=0.01``. From
step 30 the learning rate is 100x higher: the loss goes 2.3 -> 187 -> 1530
and stays in the tens to thousands for a dozen steps, and the (pre-clipping)
gradient norm jumps from about 2 to 239 at step 31 - 126x its running median.

Before the bug the run behaves like the control: its loss spikes recover, and
a 10x-the-median rule calls the noise at step 12 an ``lr_spike``. Expected
diagnosis: cause ``lr_spike``, phase ``update``, step 31, with the LR jump
(0.003 -> 0.3) and |dw|/|w| as evidence.
"""

from __future__ import annotations

import torch

try:  # imported as part of a package (``examples.heavy_tailed_lr_milestone_bug``)
    from .control_heavy_tailed_loss import DelayModel, make_batches, mse
except ImportError:  # run as a script or loaded from its path
    from control_heavy_tailed_loss import DelayModel, make_batches, mse

N_STEPS = 50   # the first 50 of the control's batches


def target():
    torch.manual_seed(0)
    model = DelayModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=3e-3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30], gamma=100)   # BUG: 0.01
    return {"model": model, "loss_fn": mse, "batches": make_batches()[:N_STEPS], "optimizer": optimizer,
            "scheduler": scheduler, "max_grad_norm": 5.0, "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
