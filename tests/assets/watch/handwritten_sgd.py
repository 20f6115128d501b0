"""A loop that updates the weights by hand, as pytorch/examples' word_language_model does by default:
``p.data.add_(p.grad, alpha=-lr)``, no torch.optim optimizer. The batch of step BAD (default 6) holds a NaN
feature: its loss is NaN (cause data), and the update it makes by hand turns every weight NaN.

    python handwritten_sgd.py [--bad 6] [--steps 12]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bad", type=int, default=6)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    lr = 0.1
    for step in range(a.steps):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        if step == a.bad:
            x[3, 2] = float("nan")
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
