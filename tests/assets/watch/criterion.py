"""The usual layout: the model returns predictions, a criterion module outside it computes the loss.

A Poisson rate regression whose rate head has no softplus; the Poisson NLL lives in ``PoissonNLL``
(an ``nn.Module`` the loop calls after the model). Training pulls some rates below zero:
``torch.log(rate)`` in the criterion makes the loss NaN while the model's outputs are finite.

    python criterion.py [--epochs 2]
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class RateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        nn.init.constant_(self.head.bias, 2.0)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


class PoissonNLL(nn.Module):
    def forward(self, rate, counts):
        return (rate - counts * torch.log(rate)).mean()   # log of a rate <= 0 is NaN


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    counts = torch.poisson(torch.exp(0.3 * x[:, 0]))
    loader = DataLoader(TensorDataset(x, counts), batch_size=8, shuffle=True)
    model, criterion = RateNet(), PoissonNLL()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    step = 0
    for _ in range(args.epochs):
        for xb, cb in loader:
            loss = criterion(model(xb), cb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step} loss {loss.item():.4f}")
            step += 1


if __name__ == "__main__":
    main()
