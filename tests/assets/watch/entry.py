"""The ENTRY for replaying own_trainer.py's capsules with the script's own loss (it lives in forward)."""

import torch

from own_trainer import PoissonNet


def target():
    torch.manual_seed(0)
    model = PoissonNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    return {"model": model, "optimizer": optimizer, "max_grad_norm": 5.0, "batches": [],
            # nanprobe watch saved the root module's inputs: batch["args"], batch["kwargs"]
            "loss_fn": lambda m, b: m(*b["args"], **b["kwargs"])}
