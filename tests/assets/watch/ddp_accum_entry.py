"""The entrypoint for ddp_accum.py's capsules: the same model, unwrapped, on one process; two
micro-batches a step, as the script accumulates them."""

import torch
import torch.nn as nn


def target():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2), "batches": [],
            "accumulate": 2, "loss_fn": lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()}
