"""AdamW with eps=0: a "kind" embedding joins the model at step FIRST_KIND (default 6). Its padding row
and unused rows get a zero gradient, so Adam's update there is m / (sqrt(v) + eps) = 0 / 0: the
update of that step makes them NaN (the loss and gradients of the step itself are finite).

    python eps_zero.py [--optimizer-flag foreach|fused] [--first-kind 6] [--steps 10]
"""

import argparse

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.kind = nn.Embedding(5, 4, padding_idx=0)

    def forward(self, x, kind=None):
        if kind is not None:
            x = x + self.kind(kind)
        return self.fc(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer-flag", choices=["foreach", "fused"], default=None)
    parser.add_argument("--first-kind", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net()
    flags = {args.optimizer_flag: True} if args.optimizer_flag else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0, **flags)
    for step in range(args.steps):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        kind = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]) if step >= args.first_kind else None
        loss = ((model(x, kind) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
