"""Bad data: a missing value in a CSV row becomes NaN in the features of step 3, sample 5.

A tabular regression MLP reads rows from a CSV; one cell is empty and ``float("")``-style parsing
turned it into NaN. Nothing in the model is wrong: the NaN enters with the batch, reaches the
loss and, through the gradient, every weight of the first layer.

Expected diagnosis: data, input, key batch['x'], step 3, sample 5.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Regressor(nn.Module):
    def __init__(self, features: int = 6):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def load_rows(steps: int = 8, batch: int = 16, features: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(features, generator=g)
    batches = []
    for step in range(steps):
        x = torch.randn(batch, features, generator=g)
        y = x @ w + 0.1 * torch.randn(batch, generator=g)
        if step == 3:
            x[5, 2] = float("nan")  # the empty CSV cell
        batches.append({"x": x, "y": y})
    return batches


def target():
    torch.manual_seed(0)
    model = Regressor()
    return {"model": model, "loss_fn": lambda m, b: F.mse_loss(m(b["x"]), b["y"]), "batches": load_rows(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3)}
