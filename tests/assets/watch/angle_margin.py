"""An angular-margin loss computed in the loop, outside the model: ``acos(cos + margin)`` with the cosine from
a division by the norms. At step BAD (default 5) a pair is an item with itself: its cosine is 1 and the margin
pushes acos's input past 1 (NaN, cause domain). The graph between the model's outputs and the loss holds a div
and an acos, so watch's in-process report cannot name one op; re-executing the step (watch --at) does.

    python angle_margin.py [--bad 5] [--steps 8]
"""

import argparse

import torch
import torch.nn as nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bad", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(a.steps):
        x1, x2 = torch.randn(6, 6), torch.randn(6, 6)
        if step == a.bad:
            x2[2] = x1[2]
        opt.zero_grad()
        e1, e2 = model(x1), model(x2)
        cos = (e1 * e2).sum(-1) / (e1.norm(dim=-1) * e2.norm(dim=-1))
        theta = torch.acos(cos + 0.05 * (cos > 0.999))   # <- a margin on near-identical pairs: acos(> 1)
        loss = theta.mean()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
