"""A functional model, as wiseodd/generative-models' GANs are written: the parameters sit in a module but its
forward is never called (methods and free tensors do the math), and the loss is a hand-written binary
cross-entropy, -mean(y log p + (1 - y) log(1 - p)). At step BAD (default 5) one sample's logit is 40: float32's
sigmoid rounds it to exactly 1.0, and log(1 - p) = log(0) = -inf.

    python functional_log.py [--bad 5] [--steps 8]
"""

import argparse

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.ParameterDict({"w": nn.Parameter(torch.randn(4, 1) * 0.1), "b": nn.Parameter(torch.zeros(1))})

    def disc(self, x):
        return torch.sigmoid(x @ self.p["w"] + self.p["b"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bad", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(a.steps):
        x, y = torch.randn(16, 4), torch.zeros(16, 1)
        if step == a.bad:
            with torch.no_grad():
                x[3] = net.p["w"].squeeze(1) * (40.0 / float(net.p["w"].square().sum()))   # x·w = 40
        p = net.disc(x)
        loss = -torch.mean(y * torch.log(p) + (1 - y) * torch.log(1 - p))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
