"""Pure bf16 training: a hand-written standardisation takes E[x^2] - E[x]^2, negative in bf16.

The usual LLM fine-tuning setup: ``model.to(torch.bfloat16)``, no autocast, an
optimizer over the bf16 weights. A sensor model standardises its readings
(around 100, spread about 0.5) with a hand-written "fast" variance,
``(x * x).mean() - x.mean() ** 2``. In fp32 that is 0.25 give or take a few
1e-4; in bf16 (8 bits of mantissa, a step of 0.5 at 100 and of 64 at 10^4) the
two terms round apart by more than the variance itself, the difference comes
out negative (or 0) and ``sqrt`` gives NaN (or the division gives Inf).

The same step is finite in fp32 and fp64: precision is the problem, not the
data or the learning rate. ``nanprobe run`` reports the run's precision as
bf16 (the weights' dtype), and ``compare-precisions`` shows bf16 NaN with fp32
and fp64 finite.

Expected diagnosis: cause ``sqrt``, phase ``forward``, module ``standardize``,
run precision ``bf16``; the fp32 rerun is finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 16, 32, 20


class FastStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=0, keepdim=True)
        var = (x * x).mean(dim=0, keepdim=True) - mean * mean   # the "one pass" variance
        return (x - mean) / var.sqrt()


class SensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.standardize = FastStandardize()
        self.body = nn.Sequential(nn.Linear(N_FEATURES, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.standardize(x)).squeeze(-1)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_STEPS):
        x = 100.0 + 0.5 * torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        y = (x[:, 0] - 100.0) * 2.0
        batches.append({"x": x, "y": y})
    return batches


def regression_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    x = batch["x"].to(torch.bfloat16)   # the model's dtype
    return F.mse_loss(model(x).float(), batch["y"])


def target():
    torch.manual_seed(0)
    model = SensorNet().to(torch.bfloat16)
    return {
        "model": model,
        "loss_fn": regression_loss,
        "batches": make_batches(),
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
