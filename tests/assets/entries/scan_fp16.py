"""A feature value beyond the fp16 range (65504) in a run that trains in fp16: step 2, sample 7."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def target():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    batches = [{"features": torch.randn(8, 4, generator=g), "target": torch.randint(0, 2, (8,), generator=g)}
               for _ in range(5)]
    batches[2]["features"][7, 0] = 1.0e5
    return {"model": nn.Linear(4, 2), "precision": "fp16",
            "loss_fn": lambda m, b: F.cross_entropy(m(b["features"]), b["target"]), "batches": batches}
