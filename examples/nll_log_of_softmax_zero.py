"""Zero probabilities into nll_loss: ``log(softmax(x))`` instead of ``log_softmax``.

A classifier's model ends in ``nn.Softmax`` (it was exported for serving that
way) and the training loss takes ``F.nll_loss(torch.log(probs), y)``. The
raw features are large (readings up to ~100) and the learning rate high, so
by step 3 the logits of some samples are hundreds apart: the softmax
probability of a losing class underflows to exactly 0 in float32 (below
1e-45) and log(0) = -inf. ``nll_loss`` only picks the true class, so the loss
stays finite - but the gradient of log at 0 is 1/0, and times the zero
upstream gradient it is NaN: the weights are poisoned by entries the loss
never used. ``F.cross_entropy`` on the logits never forms the zero.

Expected diagnosis: cause ``log``, phase ``forward``, module ``(loss_fn)``,
step 3: the log of a zero probability (masked by the selection), not an
overflow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, N_CLASSES, BATCH_SIZE, N_STEPS = 10, 5, 32, 20


class ServingClassifier(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, n_classes: int = N_CLASSES):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, 64), nn.ReLU(), nn.Linear(64, n_classes))
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.softmax(self.net(x))


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = 30 * torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        y = (x @ w).argmax(-1)
        y[torch.rand(BATCH_SIZE, generator=g) < 0.1] = torch.randint(0, N_CLASSES, (1,), generator=g)  # label noise
        batches.append((x, y))
    return batches


def nll_of_probs(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    probs = model(x)
    return F.nll_loss(torch.log(probs), y)


def target():
    torch.manual_seed(0)
    model = ServingClassifier()
    return {"model": model, "loss_fn": nll_of_probs, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=0.05), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
