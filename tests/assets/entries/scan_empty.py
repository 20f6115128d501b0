"""Ragged per-sample sequences in a dataclass batch; step 2, sample 4 is an empty sequence."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Batch:
    seqs: list            # one 1-D float tensor per sample, of varying length
    labels: torch.Tensor


def _loss(m, b):
    pooled = torch.stack([s.mean() for s in b.seqs]).unsqueeze(1)
    return F.cross_entropy(m(pooled), b.labels)


def target():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    batches = []
    for step in range(4):
        lengths = torch.randint(2, 9, (6,), generator=g).tolist()
        if step == 2:
            lengths[4] = 0
        seqs = [torch.randn(n, generator=g) for n in lengths]
        batches.append(Batch(seqs=seqs, labels=torch.randint(0, 2, (6,), generator=g)))
    return {"model": nn.Linear(1, 2), "loss_fn": _loss, "batches": batches}
