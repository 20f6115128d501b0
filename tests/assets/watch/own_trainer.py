"""A training script with its own Trainer class; the model computes its loss in forward.

The bug: a Poisson regression whose rate head has no softplus. The rates start positive (bias 2)
and training pulls some of them below zero: ``torch.log(rate)`` then produces NaN.

    python own_trainer.py [--epochs 3] [--lr 0.05] [--exit-code 0] [--healthy] [--amp] [--save weights.pt]

``--amp``: fp16 autocast with a GradScaler (on CPU too).
"""

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class PoissonNet(nn.Module):
    def __init__(self, healthy: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        nn.init.constant_(self.head.bias, 2.0)
        self.healthy = healthy

    def forward(self, x, counts):
        h = self.body(x)
        rate = self.head(h).squeeze(-1)
        if self.healthy:
            rate = F.softplus(rate)
        nll = rate - counts * torch.log(rate)   # Poisson NLL (up to a constant): log of a rate <= 0 is NaN
        return nll.mean()


class Trainer:
    def __init__(self, model: nn.Module, lr: float, epochs: int, amp: bool = False):
        self.model = model
        self.epochs = epochs
        self.amp = amp
        self.scaler = torch.amp.GradScaler("cpu", enabled=amp)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=10, gamma=0.9)

    def fit(self, loader: DataLoader) -> None:
        step = 0
        for epoch in range(self.epochs):
            for x, counts in loader:
                with torch.autocast("cpu", dtype=torch.float16, enabled=self.amp):
                    loss = self.model(x, counts)
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
                step += 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--healthy", action="store_true")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    counts = torch.poisson(torch.exp(0.3 * x[:, 0]))
    loader = DataLoader(TensorDataset(x, counts), batch_size=8, shuffle=True)
    model = PoissonNet(healthy=args.healthy)
    Trainer(model, args.lr, args.epochs, amp=args.amp).fit(loader)
    if args.save:
        torch.save(model.state_dict(), args.save)
    print("done")
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
