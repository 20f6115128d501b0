"""fp16 underflow: sigmoid of a very negative margin is 0, and ``+ 1e-8`` does not save the log.

A fraud classifier computes its loss inside the model, in a ``head`` module:
``p = sigmoid(logit)``, then ``-log(p_true + 1e-8)`` where ``p_true`` is ``p``
for fraud and ``1 - p`` otherwise; the ``1e-8`` is the usual "avoid log(0)"
epsilon. It trains under fp16 autocast
(CPU autocast keeps ``sigmoid``, ``add`` and ``log`` in fp16 when their input
is fp16, and on CUDA ``sigmoid`` and ``add`` stay fp16 too).

The features are raw transaction amounts, not standardised. At step 2 the
batch contains a mislabelled sample (sample 3: a legitimate transaction about
35 times larger than usual, labelled as fraud); a ReLU network's logit grows
with the size of its input, so the model is confidently wrong about it: its
logit is about -19. In fp32 sigmoid(-19) = 5.6e-9, ``+ 1e-8`` keeps the log
finite and the loss is ~18 for that sample. In fp16 the smallest positive
number is 6e-8: sigmoid(-19) underflows to exactly 0, and
``1e-8`` rounds to 0 as well, so the head computes log(0) = -inf and the loss
is +inf. ``F.binary_cross_entropy_with_logits`` (or ``F.logsigmoid``) computes
the same loss without ever forming the probability.

Expected diagnosis: cause ``underflow``, phase ``forward``, module ``head``
(the -inf is produced by ``aten.log`` from a 0 that ``aten.sigmoid`` flushed
to zero), step 2, sample 3; finite in fp32 and bf16.
"""

from __future__ import annotations

import torch
from torch import nn

N_FEATURES, BATCH_SIZE, N_STEPS = 8, 16, 20


class LogisticHead(nn.Module):
    """Logit, then the negative log-likelihood of the true label, per sample."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, 1)

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logit = self.linear(h).squeeze(-1)
        p = torch.sigmoid(logit)                   # P(fraud)
        p_true = torch.where(y > 0.5, p, 1 - p)    # probability of the true label
        return -torch.log(p_true + 1e-8)


class FraudClassifier(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = LogisticHead(hidden)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x), y)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(N_FEATURES, generator=g)
    batches = []
    for step in range(N_STEPS):
        x = 4.0 * torch.randn(BATCH_SIZE, N_FEATURES, generator=g)   # raw amounts: not standardised
        y = (x @ direction > 0).float()
        if step == 2:
            # A legitimate transaction ~35x larger than usual, labelled as fraud by mistake.
            x[3] = -400.0 * direction / direction.norm()
            y[3] = 1.0
        batches.append({"features": x, "label": y})
    return batches


def nll(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["features"], batch["label"]).mean()


def target():
    torch.manual_seed(0)
    model = FraudClassifier()
    return {
        "model": model,
        "loss_fn": nll,
        "batches": make_batches(),
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2),
        "precision": "fp16",
        "grad_scaler": False,
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
