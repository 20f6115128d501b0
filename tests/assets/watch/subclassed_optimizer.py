"""A script whose optimizer subclasses AdamW and calls ``super().step()``, while a plain AdamW exists too.

Once the base class has an instance, torch runs the optimizer step hooks at both levels of the subclass's
step (its own ``step`` and ``AdamW.step`` are both patched): one training step, two hook pairs. At step BAD
(default 3) the batch holds a NaN feature.

    python subclassed_optimizer.py [--steps 6] [--bad 3]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class WarmupAdamW(torch.optim.AdamW):
    def __init__(self, params, lr, warmup=3):
        super().__init__(params, lr=lr)
        self.warmup, self.calls = warmup, 0

    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            group["lr"] = group.setdefault("base_lr", group["lr"]) * min(1.0, self.calls / self.warmup)
        return super().step(closure)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bad", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    probe = nn.Linear(4, 2)
    torch.optim.AdamW(probe.parameters(), lr=1e-3)   # a plain AdamW: AdamW.step gets torch's hook wrapper
    opt = WarmupAdamW(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        if step == args.bad:
            x[5, 1] = float("nan")
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
