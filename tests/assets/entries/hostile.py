"""Entrypoints that misbehave in the ways users' code does: exits, interrupts, prints, empty or endless
data, state kept in odd places. Each is small and otherwise healthy."""

import itertools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


def _build(batches=None, loss_fn=None, **extra):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    if batches is None:
        batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(6)]
    out = {"model": model, "loss_fn": loss_fn or (lambda m, b: F.cross_entropy(m(b[0]), b[1])), "batches": batches,
           "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    out.update(extra)
    return out


def healthy():
    return _build()


def exits_0():
    calls = [0]

    def loss_fn(m, b):
        calls[0] += 1
        if calls[0] == 3:
            sys.exit(0)          # "done early": must never read as a healthy run
        return F.cross_entropy(m(b[0]), b[1])
    return _build(loss_fn=loss_fn)


def exits_1():
    def loss_fn(m, b):
        sys.exit(1)              # must never read as "a problem was found"
    return _build(loss_fn=loss_fn)


def exits_at_import_time():
    return _build(batches=[sys.exit(3)])


def interrupted():
    calls = [0]

    def loss_fn(m, b):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return F.cross_entropy(m(b[0]), b[1])
    return _build(loss_fn=loss_fn)


def empty():
    return _build(batches=[])


def endless():
    """An iterable with no length that never ends (a streaming dataset)."""
    class Stream:
        def __iter__(self):
            g = torch.Generator().manual_seed(1)
            for _ in itertools.count():
                yield torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)
    return _build(batches=Stream())


def prints():
    def loss_fn(m, b):
        print("loss_fn says hello")            # what users' code does
        return F.cross_entropy(m(b[0]), b[1])
    print("building the model")
    return _build(loss_fn=loss_fn)


def epochs_zero():
    return _build(epochs=0)


def accumulate_bad():
    return _build(accumulate=-2)


def step_and_loss():
    return _build(step_fn=lambda m, b, s: None)


def step_fn_not_callable():
    out = _build(step_fn=3)
    del out["loss_fn"]
    return out


def optimizer_list_bad():
    return _build(optimizer=[torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)])


def grad_scaler_with_step_fn():
    out = _build(step_fn=lambda m, b, s: None, grad_scaler=True, precision="fp16")
    del out["loss_fn"]
    return out


def max_grad_norm_with_step_fn():
    out = _build(step_fn=lambda m, b, s: None, max_grad_norm=1.0)
    del out["loss_fn"]
    return out


def one_shot():
    return _build(batches=iter([(torch.randn(6, 4), torch.randint(0, 2, (6,)))]))


def ignore_index_bad():
    return _build(ignore_index="x")


def scheduler_on_skip_bad():
    return _build(scheduler_on_skip="yes")


def grad_scaler_object_bad():
    return _build(grad_scaler="yes")


def step_fn_bad_return():
    opt = []

    def step_fn(model, batch, step):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt[0].step()
        return model(batch[0])     # not a scalar: a report of "the loss" would be meaningless
    out = _build(step_fn=step_fn)
    del out["loss_fn"]
    opt.append(out["optimizer"])
    return out


def nan_constant():
    """The loss times a NaN constant on the 4th call: no op produces the NaN, it enters from the code."""
    calls = [0]

    def loss_fn(m, b):
        calls[0] += 1
        loss = F.cross_entropy(m(b[0]), b[1])
        if calls[0] == 4:
            loss = loss * float("nan")
        return loss
    return _build(loss_fn=loss_fn)


def loss_scaled_once():
    """The loss of step 7 is multiplied by 1e4 (a bug in the loss code, not the data and not the LR): Adam,
    clipped, with ordinary batches; the spike recovers at once."""
    calls = [0]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(12)]

    def loss_fn(m, b):
        calls[0] += 1
        loss = F.cross_entropy(m(b[0]), b[1])
        return loss * 1e4 if calls[0] == 8 else loss
    out = _build(batches=batches, loss_fn=loss_fn, max_grad_norm=1.0)
    out["optimizer"] = torch.optim.Adam(out["model"].parameters(), lr=1e-3)
    return out
