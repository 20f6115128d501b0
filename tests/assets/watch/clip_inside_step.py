"""An optimizer that clips inside its own step(), as pytorch-pretrained-BERT's BertAdam does, and a NaN batch at
step BAD (default 4). The script prints each step's gradient norm before that clip, as watch must read it.

    python clip_inside_step.py [--bad 4]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class ClippingSGD(torch.optim.Optimizer):
    """SGD that clips the gradients inside its own step (its own step: no call to another optimizer's)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], 0.01)   # <- inside step(): after watch's check
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bad", type=int, default=4)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = ClippingSGD(model.parameters(), lr=0.1)
    for step in range(a.bad + 2):
        x, y = torch.randn(8, 4) * (1 + step), torch.randint(0, 3, (8,))
        if step == a.bad:
            x[1, 1] = float("nan")
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        print(f"step {step} grad_norm {norm.item():.6g}")
        opt.step()


if __name__ == "__main__":
    main()
