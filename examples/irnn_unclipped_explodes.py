"""An IRNN trained without gradient clipping: an early excursion that recovers, then a real explosion.

A ReLU RNN with its recurrent matrix initialised to the identity (an IRNN, Le et al. 2015) classifies
sequences of 50 steps. The IRNN recipe trains it with SGD and gradient clipping; this run forgot the
clipping. The identity recurrence sits exactly at the edge of stability, so a gradient step that pushes
the recurrent gain above 1 is amplified over the 50 time steps:

- step 2: the loss jumps from 6.8 to about 3e3 (the step-1 update raised the recurrent gain), and the
  next update brings it back: by step 3 the loss is 3.2 again. Training goes on, noisy (losses 2-15);
- hundreds of steps later (step 329 on an AVX2 CPU with one thread; 419, 567 or 695 with AVX-512 or two
  threads: the run sits at the edge of stability, so the last bit of each matmul decides when) the loss
  is about 1e7-1e13 and the unclipped gradient norm orders of magnitude above it; that update writes
  inf/NaN into the recurrent weights, and the next step is NaN everywhere.

Stopping at step 2 would blame an excursion the run recovered from. Expected diagnosis (``nanprobe run``
without ``--at``): the first step that does not recover (330 in the first case), cause ``lr_spike`` (the
update of the step before it grew the weights by orders of magnitude, unclipped), with the step-2
excursion as its ``onset``, and clipping as the first fix. The usual fix: ``clip_grad_norm_(model.parameters(), 1.0)`` (and a lower LR).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, STEPS_PER_SEQ, N_INPUTS, N_CLASSES, BATCH_SIZE = 64, 50, 8, 10, 32


class IRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(N_INPUTS, HIDDEN, nonlinearity="relu", batch_first=True)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(HIDDEN))    # the identity recurrence of an IRNN
            self.rnn.bias_hh_l0.zero_()
            self.rnn.bias_ih_l0.zero_()
            self.rnn.weight_ih_l0.normal_(0, 0.001 ** 0.5)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Sequences:
    """The training stream: noise sequences; the class is the signs of the sums of two input channels.
    Each pass draws the same sequences (a fixed seed), like a seeded DataLoader."""

    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        while True:
            x = torch.randn(BATCH_SIZE, STEPS_PER_SEQ, N_INPUTS, generator=g)
            y = (x[:, :, 0].sum(1) > 0).long() + 2 * (x[:, :, 1].sum(1) > 0).long()
            yield {"x": x, "labels": y}


def cross_entropy(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b["x"]), b["labels"])


def target():
    torch.manual_seed(0)
    model = IRNN()
    return {"model": model, "loss_fn": cross_entropy, "batches": Sequences(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),   # BUG: no max_grad_norm
            "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=1200)
