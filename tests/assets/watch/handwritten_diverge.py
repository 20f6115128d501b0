"""A loop that updates the weights by hand (no torch.optim optimizer), as pytorch/examples' word_language_model
does, with its LR raised from 0.5 to LR (default 20) at step AT (default 4): the loss leaves its level at once
and never comes back, finite all along, while the output head's log Z grows 100x.

    python handwritten_diverge.py [--lr 20] [--at 4] [--steps 40]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=20.0)
    ap.add_argument("--at", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 10))
    teacher = torch.randn(16, 10)
    for step in range(a.steps):
        x = torch.randn(32, 16)
        y = (x @ teacher).argmax(-1)
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-(a.lr if step >= a.at else 0.5))
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
