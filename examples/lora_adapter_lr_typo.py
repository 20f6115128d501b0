"""LoRA fine-tuning with the adapters' learning rate typed as 1e3 instead of 1e-3.

A frozen pretrained MLP gets low-rank adapters (``lora_a``, ``lora_b``) on its
first layer; the head is fine-tuned too. The optimizer has two param groups,
the head at ``lr=1e-3`` (listed first) and the adapters at ``lr=1e3`` (a typo
for 1e-3). AdamW moves each adapter weight by about the LR per step, so after
one step the adapters weigh ~1000, the activations ~1e6 and the loss grows by
orders of magnitude each step until it overflows.

The first param group's LR (what most tools print) is a healthy 1e-3; the
evidence must quote the LR of the group that owns the module that blew up.

Expected diagnosis: cause ``lr_spike``, phase ``update``, module ``body.0``
(the adapted layer; its adapters' group has lr 1000).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, HIDDEN, RANK, BATCH_SIZE, N_STEPS = 16, 32, 4, 32, 30


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = RANK):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)          # pretrained, frozen
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(LoRALinear(N_FEATURES, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        out.append({"x": x, "y": x[:, :3].sum(1)})
    return out


def mse(model: nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def target():
    torch.manual_seed(0)
    model = Model()
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.AdamW([{"params": model.head.parameters(), "lr": 1e-3},
                             {"params": adapters, "lr": 1e3}])   # typo: meant 1e-3
    return {"model": model, "loss_fn": mse, "batches": make_batches(), "optimizer": opt}


if __name__ == "__main__":
    from plain_loop import train

    train(target())
