"""A healthy loop that copies and saves its model the usual ways while training: a best-model
snapshot (``copy.deepcopy``), ``AveragedModel`` (SWA), an EMA copy, ``torch.save(model)``, state_dict
round trips of the model and the optimizer; LBFGS (a closure optimizer) with ``--lbfgs``.

    python copies.py --out weights.pt [--lbfgs] [--bad-step N]

``--bad-step N``: a NaN in the batch of step N. The copies are checked: each must be a working model
(its forward runs) and pickles must hold no reference to anything but torch and the stdlib.
"""

import argparse
import copy
import io
import pickle

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel


class _Standalone(pickle.Unpickler):
    """Unpickles what loads without nanprobe installed."""

    def find_class(self, module, name):
        assert not module.startswith("nanprobe"), f"the pickled model refers to {module}.{name}"
        return super().find_class(module, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--lbfgs", action="store_true")
    parser.add_argument("--bad-step", type=int, default=-1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4) if args.lbfgs else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    swa = AveragedModel(model)
    ema = copy.deepcopy(model)
    best = None
    for step in range(6):
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        if step == args.bad_step:
            x[0, 0] = float("nan")

        def closure():
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        if args.lbfgs:
            opt.step(closure)
        else:
            closure()
            opt.step()
        swa.update_parameters(model)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        best = copy.deepcopy(model)
        best(x)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        torch.load(buf, weights_only=False)(x)
        _Standalone(io.BytesIO(pickle.dumps(model))).load()(x)
        model.load_state_dict(copy.deepcopy(model.state_dict()))
        opt.load_state_dict(pickle.loads(pickle.dumps(opt.state_dict())))
        copy.deepcopy(opt)
    torch.save({"model": model.state_dict(), "swa": swa.state_dict(), "ema": ema.state_dict(),
                "best": best.state_dict()}, args.out)


if __name__ == "__main__":
    main()
