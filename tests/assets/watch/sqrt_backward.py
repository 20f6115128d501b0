"""A NaN born in backward inside the model: the gradient of sqrt at 0.

A siamese net's ``distance`` module computes ``sqrt(((a - b) ** 2).sum(-1))``; at step BAD (default 4)
one pair is an item with itself, so that distance is exactly 0: the forward and the loss are finite,
``SqrtBackward0`` makes 0 / 0 = NaN in backward (module ``distance``, sample 2). The loss (a contrastive
loss) is computed in the loop, outside the model.

    python sqrt_backward.py [--bad 4] [--steps 8] [--random] [--marker FILE] [--check] [--compile BACKEND]

``--random``: the bad step is drawn with Python's ``random`` (unseeded) and the inputs get numpy noise
(unseeded): only a rerun from the same host RNG states reproduces the run. ``--marker FILE``: the pair is
bad only when FILE does not exist yet (the script creates it): a run that never reproduces. ``--check``:
the script raises on non-finite gradients (its own check, before ``optimizer.step()``). ``--compile``:
the model is ``torch.compile``'d with that backend.
"""

import argparse
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Distance(nn.Module):
    def forward(self, a, b):
        return torch.sqrt(((a - b) ** 2).sum(-1))


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
        self.distance = Distance()

    def forward(self, a, b):
        return self.distance(self.encoder(a), self.encoder(b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bad", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--random", action="store_true")
    parser.add_argument("--marker", default=None)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--compile", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    bad = random.randrange(2, args.steps - 1) if args.random else args.bad
    if args.marker is not None:
        if os.path.exists(args.marker):
            bad = -1
        else:
            open(args.marker, "w").close()
    model = Siamese()
    if args.compile:
        model = torch.compile(model, backend=args.compile)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(args.steps):
        a, b = torch.randn(6, 6), torch.randn(6, 6)
        if args.random:
            a = a + torch.from_numpy(np.random.randn(6, 6).astype("float32"))
        same = torch.tensor([1.0, 0.0] * 3)
        if step == bad:
            b[2] = a[2]   # an item paired with itself: distance exactly 0
        d = model(a, b)
        loss = (same * d ** 2 + (1 - same) * F.relu(2.0 - d) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        if args.check and not grads_ok:
            raise RuntimeError(f"non-finite gradients at step {step}")
        opt.step()
        print(f"step {step} loss {loss.item():.4f} grads {'ok' if grads_ok else 'nan'}")


if __name__ == "__main__":
    main()
