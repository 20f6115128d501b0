"""Zero probabilities in KL distillation: -inf teacher log-probs, 0 * inf = NaN.

A student is distilled from a large teacher whose outputs were precomputed
and stored to save compute: only the teacher's top-8 classes of 32 keep their
log-probability, the rest is stored as ``-inf`` (probability exactly 0, as the
truncation intends). The loss is ``F.kl_div(student_logp, teacher_logp,
log_target=True)``, which computes exp(t) * (t - s) per entry: for a truncated
class that is exp(-inf) * (-inf - s) = 0 * (-inf) = NaN. The zero probability
is legitimate, its contribution to KL is 0 - the formula turns it into NaN.

The batch holds -inf on purpose, so "clean the data" is the wrong advice.
Expected diagnosis: cause ``data`` (zero probabilities written as -inf),
phase ``forward``, module ``(loss_fn)``, step 0; fix: clamp the -inf
log-probabilities or pass probabilities (xlogy gives 0 * log 0 = 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, N_CLASSES, TOP_K, BATCH_SIZE, N_STEPS = 16, 32, 8, 16, 6


class Student(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, n_classes: int = N_CLASSES):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, 64), nn.ReLU(), nn.Linear(64, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    teacher_w = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        logits = x @ teacher_w
        top = logits.topk(TOP_K, dim=-1)
        kept = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
        batches.append({"x": x, "teacher_logp": kept.log_softmax(-1)})   # -inf = probability 0 (truncated)
    return batches


def distill(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    student_logp = model(batch["x"]).log_softmax(-1)
    return F.kl_div(student_logp, batch["teacher_logp"], log_target=True, reduction="batchmean")


def target():
    torch.manual_seed(0)
    model = Student()
    return {"model": model, "loss_fn": distill, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
