"""fp16 weights with fp32 master copies (the classic mixed-precision recipe), and an fp16 overflow.

Before autocast, mixed precision was written by hand (NVIDIA's apex "O2", Megatron, many research
codebases): the model is cast to fp16, the optimizer steps fp32 master copies of its parameters,
the loss is scaled by hand, each step copies the fp16 gradients into the masters (unscaled) and the
updated masters back into the fp16 model. The optimizer's tensors are not the model's parameters,
they mirror them.

Here an attention-like scoring block computes ``q @ k^T`` without the 1/sqrt(d) scale; its inputs
grow with the learning rate until a score passes fp16's 65504 and becomes inf (step 5 or so,
depending on the fp16 kernels), then softmax gives NaN.

Expected diagnosis: cause ``overflow``, phase ``forward``, module ``attn``; the run's precision is
fp16 (its weights), the fp32 rerun (weights, masters and batch in fp32) is finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D, N_TOKENS, BATCH_SIZE, N_STEPS, LOSS_SCALE = 32, 8, 16, 30, 128.0


class Attn(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1)     # no / sqrt(d)
        return scores.softmax(-1) @ x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.attn = Attn()
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.embed(x)).mean(1))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_TOKENS, 4, generator=g)
        out.append({"x": x.half(), "y": (x[:, 0, 0] > 0).long() + (x[:, 0, 1] > 1).long()})
    return out


def make():
    torch.manual_seed(0)
    model = Net().half()
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    optimizer = torch.optim.Adam(masters, lr=0.3)   # far too high: the scores grow every step
    return model, masters, optimizer


def train_step(model, masters, optimizer, batch) -> torch.Tensor:
    loss = F.cross_entropy(model(batch["x"]).float(), batch["y"])
    model.zero_grad(set_to_none=True)
    (loss * LOSS_SCALE).backward()
    for p, m in zip(model.parameters(), masters):
        m.grad = p.grad.float() / LOSS_SCALE
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters):
            p.copy_(m)
    return loss


def target():
    model, masters, optimizer = make()
    return {"model": model, "optimizer": optimizer, "batches": make_batches(),
            "step_fn": lambda model, batch, step: train_step(model, masters, optimizer, batch)}


def first_bad_step() -> int | None:
    """The plain loop: the first step whose loss is not finite."""
    model, masters, optimizer = make()
    for step, batch in enumerate(make_batches()):
        if not torch.isfinite(train_step(model, masters, optimizer, batch)):
            return step
    return None


if __name__ == "__main__":
    print("first non-finite loss at step", first_bad_step())
