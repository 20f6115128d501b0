"""Warnings only: an extreme outlier (step 15, sample 3) and an all-zero feature batch (step 9)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def target():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    batches = [{"x": torch.randn(16, 8, generator=g), "y": torch.randint(0, 2, (16,), generator=g)}
               for _ in range(24)]
    batches[15]["x"][3, 5] = 1000.0
    batches[9]["x"].zero_()
    return {"model": nn.Linear(8, 2), "loss_fn": lambda m, b: F.cross_entropy(m(b["x"]), b["y"]), "batches": batches}


def early_outlier():
    """The outlier sits in the warmup batches (step 1, sample 0): judged once warmup ends."""
    t = target()
    t["batches"][15]["x"][3, 5] = 0.5
    t["batches"][9]["x"].normal_()
    t["batches"][1]["x"][0, 0] = -800.0
    return t
