"""A real GradScaler skip storm: gradients beyond fp16 even without the loss scale.

An fp16 model estimates the energy of molecular configurations (in meV, values
in the thousands) and the loss is a *sum* of squared errors over the batch and
over 64 atoms per sample (``reduction="sum"``, as in the paper's code). A
gradient in the output layer's backward then reaches about 1e6 (the errors
summed over batch and atoms): past the fp16 maximum (65504) whatever the loss
scale. GradScaler skips the
update and halves the scale, again and again: 65536, 32768, ..., 1, 0.5 - and
still every step overflows. Nothing is ever applied.

A skip storm is the scale collapsing below 1 while the scaler still skips.
Expected diagnosis: cause ``overflow``, phase ``backward``, step 17 (the first
skip at a scale below 1), evidence: the value is beyond fp16 even unscaled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ATOMS, FEATURES, BATCH_SIZE, N_STEPS = 64, 8, 16, 24


class EnergyModel(nn.Module):
    def __init__(self, features: int = FEATURES, hidden: int = 32):
        super().__init__()
        self.atom_mlp = nn.Sequential(nn.Linear(features, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, atoms: torch.Tensor) -> torch.Tensor:
        return self.atom_mlp(atoms).squeeze(-1)       # per-atom energy contributions (B, ATOMS)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(FEATURES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        atoms = torch.randn(BATCH_SIZE, ATOMS, FEATURES, generator=g)
        energy = 2000.0 + 500.0 * torch.tanh(atoms @ w)            # meV per atom
        batches.append((atoms, energy))
    return batches


def summed_squared_error(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    atoms, energy = batch
    return F.mse_loss(model(atoms).float(), energy, reduction="sum")


def target():
    torch.manual_seed(0)
    model = EnergyModel()
    return {"model": model, "loss_fn": summed_squared_error, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp16", "grad_scaler": True}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
