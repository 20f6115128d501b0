"""yunjey/pytorch-tutorial's feed-forward ``NeuralNet`` trained on a tabular CSV with one missing cell.

Source: https://github.com/yunjey/pytorch-tutorial, tutorials/01-basics/feedforward_neural_network/main.py, commit 0500d3df5a2a8080ccfccbc00aca0eacc21818db, license MIT.
Changed: MNIST (a download) is replaced by a tabular CSV made here as text (400 rows, 8 numeric features, 3
classes) and parsed with numpy.genfromtxt, as tabular users of the tutorial do; one cell of row 137 is
empty, which genfromtxt reads as NaN; hidden size 64, batch 32 shuffled with a seeded generator, Adam 1e-3.
Kind: broken. The batch holding row 137 reaches the model with a NaN feature: fc1's output row is NaN, the
cross-entropy is NaN and every gradient is NaN (first non-finite step 3, after 3 finite steps with loss
1.27 -> 1.21). Imputing the missing cell with the column mean holds (final level 0.35).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 60
KIND = "broken"
FIXES = {"impute": "fill missing CSV cells with the column mean (np.nanmean) before training"}
TRUTH = {"cause": "data", "mechanism": None, "module": None, "onset": None,
         "how": ("Public report: https://github.com/tensorflow/tensorflow/pull/5024 (a missing value in the tutorial's "
                 'CSV data set is read as NaN/None and breaks training; fixed by dropping the rows). Here '
                 'numpy.genfromtxt reads the empty cell of row 137 (column f5) as NaN; the shuffled batch of step 3 '
                 'carries it into fc1, whose output row is NaN, so the cross-entropy (1.27 -> 1.21 over steps 0-2) and '
                 'every gradient are NaN at step 3. No op makes the NaN: it is in the input batch.')}

MISSING_ROW, MISSING_COL = 137, 5


def make_csv(n=400, d=8, seed=0) -> str:
    """A tabular data set as CSV text: 8 numeric features, a 3-class label; one cell left empty."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 2.0, size=(3, d))
    y = rng.integers(0, 3, size=n)
    x = centers[y] + rng.normal(0, 1.5, size=(n, d))
    lines = [",".join([f"f{j}" for j in range(d)] + ["label"])]
    for i in range(n):
        cells = [f"{v:.4f}" for v in x[i]]
        if i == MISSING_ROW:
            cells[MISSING_COL] = ""          # a missing value in the export
        lines.append(",".join(cells + [str(y[i])]))
    return "\n".join(lines) + "\n"


# Fully connected neural network with one hidden layer (as in the tutorial)
class NeuralNet(nn.Module):
    def __init__(self, input_size, hidden_size, num_classes):
        super(NeuralNet, self).__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden_size, num_classes)

    def forward(self, x):
        out = self.fc1(x)
        out = self.relu(out)
        out = self.fc2(out)
        return out


criterion = nn.CrossEntropyLoss()


def loss_fn(model, batch):
    features, labels = batch
    return criterion(model(features), labels)


def load(fix=None):
    table = np.genfromtxt(io.StringIO(make_csv()), delimiter=",", skip_header=1)
    x, y = table[:, :-1], table[:, -1].astype(np.int64)
    if fix == "impute":
        col_mean = np.nanmean(x, axis=0)
        x = np.where(np.isnan(x), col_mean, x)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(0)
    x, y = load(fix)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:320], y[:320]), batch_size=32,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    model = NeuralNet(8, 64, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return {"model": model, "loss_fn": loss_fn, "batches": loader, "epochs": 10, "optimizer": opt}


def evaluate(model):
    x, y = load("impute")
    with torch.no_grad():
        return float(criterion(model(x[320:]), y[320:]))


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
