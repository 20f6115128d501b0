"""log(softmax(x)) under fp16 autocast, as NVIDIA/apex issue 379 reports: at step BAD (default 3) one sample's
logits span 30 nats, so fp16's softmax rounds the smallest probability (e^-30, below fp16's smallest subnormal
6e-8) to exactly 0, and log gives -inf. nll_loss gathers only the target class, so the loss stays finite and
LogBackward's 0 * inf makes the gradients NaN. In float32 the probability is 9e-14: the cause is underflow.

    python fp16_logprob.py [--bad 3] [--steps 6]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bad", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(8, 5, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(a.steps):
        x = torch.randn(16, 8)
        if step == a.bad:   # scale one sample so its logits span exactly 30 (logits are linear in x)
            with torch.no_grad():
                z = model(x[2])
                x[2] *= 30.0 / float(z.max() - z.min())
        with torch.no_grad():
            y = model(x).argmax(1)   # the target is each sample's largest logit: the underflowed one is not
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = F.nll_loss(torch.log(F.softmax(out, dim=1)), y)
        opt.zero_grad()
        loss.backward()
        bad = any(not torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        print(f"step {step} loss {loss.item():.4f} grads {'nan' if bad else 'ok'}")


if __name__ == "__main__":
    main()
