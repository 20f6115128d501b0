"""A missing value in a CSV file becomes a NaN feature and poisons one batch.

The training data is a CSV of sensor readings. One cell in row 53 is empty, the
loader turns empty cells into ``float("nan")`` (what ``pandas.read_csv`` does
too), and nothing checks for it. The data is not shuffled, so with 16 rows per
batch that row is sample 5 of the batch at step 3. The forward pass of that
sample is NaN, the mean-squared error is NaN, every gradient is NaN, and after
Adam's update every weight is NaN.

Expected diagnosis: cause ``data``, phase ``input``, no module; step 3, batch
key ``x``, sample 5.
"""

from __future__ import annotations

import csv
import io

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES = 6
BATCH_SIZE = 16
N_STEPS = 20


class Regressor(nn.Module):
    def __init__(self, n_features: int, hidden: int = 32):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(n_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)).squeeze(-1)


def make_csv(n_rows: int, seed: int = 0) -> str:
    """The sensor export: ``f0..f5,target``; row 53 lost its ``f2`` reading."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, generator=g)
    x = torch.randn(n_rows, N_FEATURES, generator=g)
    y = x @ w + 0.1 * torch.randn(n_rows, generator=g)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([f"f{i}" for i in range(N_FEATURES)] + ["target"])
    for r in range(n_rows):
        cells = [f"{v:.5f}" for v in x[r].tolist()] + [f"{y[r].item():.5f}"]
        if r == 53:
            cells[2] = ""  # the sensor dropped out for this reading
        writer.writerow(cells)
    return out.getvalue()


def load_batches(text: str, batch_size: int) -> list[dict[str, torch.Tensor]]:
    rows = list(csv.DictReader(io.StringIO(text)))

    def num(cell: str) -> float:
        return float(cell) if cell.strip() else float("nan")  # missing -> NaN

    x = torch.tensor([[num(r[f"f{i}"]) for i in range(N_FEATURES)] for r in rows])
    y = torch.tensor([num(r["target"]) for r in rows])
    return [{"x": x[i:i + batch_size], "y": y[i:i + batch_size]}
            for i in range(0, len(rows), batch_size)]


def mse_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def target():
    torch.manual_seed(0)
    model = Regressor(N_FEATURES)
    batches = load_batches(make_csv(BATCH_SIZE * N_STEPS), BATCH_SIZE)
    return {
        "model": model,
        "loss_fn": mse_loss,
        "batches": batches,
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
