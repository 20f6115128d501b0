"""exp overflow in fp32: a hand-written softplus log(1 + exp(x)) meets an outlier batch.

A model uses a smooth activation written out by hand in ``encoder.act``. At step 3 a batch from
a sensor glitch has values around 100; the pre-activation exceeds 88.7, exp overflows float32 to
inf, and log(1 + inf) = inf. ``F.softplus`` switches to the linear branch for large inputs and
would not overflow.

Expected diagnosis: overflow, forward, module ``encoder.act`` (aten.exp).
"""

import torch
import torch.nn.functional as F
from torch import nn


class SoftPlus(nn.Module):
    def forward(self, x):
        return torch.log(1 + torch.exp(x))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 16)
        self.act = SoftPlus()

    def forward(self, x):
        return self.act(self.lin(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).squeeze(-1)


def make_batches(steps: int = 6):
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = torch.randn(8, 4, generator=g)
        if step == 3:
            x[2] = 300.0  # a sensor glitch
        out.append((x, x.sum(-1)))
    return out


def target():
    torch.manual_seed(0)
    model = Model()
    return {"model": model, "loss_fn": lambda m, b: F.mse_loss(m(b[0]), b[1]), "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3)}
