"""Float features with non-finite values at one step: step 3, samples 2 (inf) and 5 (NaN)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def target():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(8, 4, generator=g), "labels": torch.randint(0, 3, (8,), generator=g)}
               for _ in range(6)]
    batches[3]["x"][5, 1] = float("nan")
    batches[3]["x"][2, 3] = float("inf")
    model = nn.Linear(4, 3)
    return {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b["x"]), b["labels"]), "batches": batches}
