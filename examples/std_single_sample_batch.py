"""Batch standardisation with ``x.std(dim=0)``: the last batch of the epoch holds one sample.

A tabular regressor standardises its features per batch (a hand-rolled
"batch whitening", ``(x - x.mean(0)) / (x.std(0) + 1e-5)``). The data set has
65 rows and the loader uses ``batch_size=16`` without ``drop_last``, so the
epoch's fifth batch (step 4) holds a single row. ``std`` is unbiased by default
(divides by N - 1): over one sample it computes 0 / 0 = NaN, and the eps added
after it does not help. That is a division, not a square root of something
negative: the fix is in the data pipeline (``drop_last=True``) or in the
estimator (``correction=0``), not an eps inside a sqrt.

Expected diagnosis: cause ``div``, phase ``forward``, module ``whiten``
(``aten.std``), step 4, with the data fact that the batch had one sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_ROWS, N_FEATURES, BATCH_SIZE = 65, 8, 16


class BatchWhiten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=0)) / (x.std(dim=0) + 1e-5)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.whiten = BatchWhiten()
        self.mlp = nn.Sequential(nn.Linear(N_FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.whiten(x)).squeeze(-1)


def make_loader(seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = 3.0 + 2.0 * torch.randn(N_ROWS, N_FEATURES, generator=g)
    y = x[:, :2].sum(1) + 0.1 * torch.randn(N_ROWS, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=False)   # no drop_last


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target():
    torch.manual_seed(0)
    model = Regressor()
    return {"model": model, "loss_fn": mse, "batches": make_loader(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3)}


if __name__ == "__main__":
    from plain_loop import train

    train(target())
