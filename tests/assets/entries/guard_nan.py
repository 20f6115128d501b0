"""Guard/capsule/smoke test targets: a tiny classifier whose input normalisation has no eps.

Batch ``BAD_STEP`` holds an all-zero sample, so ``x / x.norm()`` is 0/0 = NaN in the forward
pass of module ``norm`` (cause ``div``). ``healthy`` has no such sample.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BAD_STEP = 4
STEPS = 10


class Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)  # no eps: a zero row gives 0/0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Normalize()
        self.fc1 = nn.Linear(4, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(self.norm(x)))))


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


def make_batches(bad_step=BAD_STEP, steps=STEPS, kind="tuple"):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        x = torch.randn(8, 4, generator=g) + 0.5
        y = torch.randint(0, 3, (8,), generator=g)
        if i == bad_step:
            x[2] = 0.0
        if kind == "dict":
            out.append({"x": x, "y": y, "meta": {"ids": list(range(8)), "source": "synthetic"}})
        elif kind == "dataclass":
            out.append(Batch(x=x, y=y))
        else:
            out.append((x, y))
    return out


def loss_fn(model, batch):
    if isinstance(batch, tuple) and len(batch) == 3:   # (x, y, loss multiplier): a loss spike on demand
        x, y, scale = batch
        return F.cross_entropy(model(x), y) * scale
    if isinstance(batch, dict):
        x, y = batch["x"], batch["y"]
    elif isinstance(batch, Batch):
        x, y = batch.x, batch.y
    else:
        x, y = batch
    return F.cross_entropy(model(x), y)


def build(bad_step=BAD_STEP, kind="tuple", **overrides):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"model": model, "loss_fn": loss_fn, "batches": make_batches(bad_step, kind=kind), "optimizer": opt,
           "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}
    out.update(overrides)
    return out


def target():
    return build()


def dict_batches():
    return build(kind="dict")


def dataclass_batches():
    return build(kind="dataclass")


def healthy():
    return build(bad_step=-1)


def fp16_scaler():
    return build(bad_step=-1, precision="fp16", grad_scaler=True)


def other_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    return {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]),
            "batches": make_batches(-1), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def spike():
    """A finite loss 1000x its running median at step 14 (the guard's default needs 10 steps of history)."""
    t = build(bad_step=-1)
    t["batches"] = [(x, y, 1000.0 if i == 14 else 1.0) for i, (x, y) in enumerate(make_batches(-1, steps=16))]
    return t
