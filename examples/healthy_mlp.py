"""Healthy: a small fp32 MLP classifier trains 20 clean steps. nanprobe exits 0 with no finding."""

import torch
import torch.nn.functional as F
from torch import nn


def target():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(20)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]), "batches": batches,
            "optimizer": optimizer, "max_grad_norm": 1.0}
