"""The entrypoint for fsdp2_trainer.py's capsules: the same model, unsharded, on one process."""

import torch
import torch.nn as nn


def target():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2), "batches": [],
            "max_grad_norm": 1.0, "loss_fn": lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()}
