"""A one-off glitch: the step that went NaN is finite when it is run again.

This example simulates what a flaky GPU, a bad DIMM or a race in a custom
kernel looks like from the training loop: one activation gets a bit flipped,
once. ``loss_fn`` counts its calls in a module-level counter and, on the 5th
call ever in this process (step 4 of the first run), sets the exponent bits of
one logit, turning it into NaN (inf for a zero mantissa); the cross-entropy
of that batch is NaN. Every later call is clean, so rerunning step 4 from the
same state with the same batch is finite. The model, the data and the optimizer are all fine.

The counter is deliberately not reset by ``target()``: a tool that rebuilds the
target and replays the run in the same process sees the glitch only once.
(Run in a fresh process, the glitch happens again at step 4.)

Expected diagnosis: cause ``not_reproduced`` at step 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, N_CLASSES, BATCH_SIZE, N_STEPS = 10, 3, 16, 20
GLITCH_ON_CALL = 5
_calls = 0


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(N_FEATURES, 32), nn.ReLU())
        self.head = nn.Linear(32, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000),
                  torch.float16: (torch.int16, 0x7C00),
                  torch.bfloat16: (torch.int16, 0x7F80)}


def _flip_exponent_bits(t: torch.Tensor) -> torch.Tensor:
    """What a hardware fault can do to one value: all exponent bits set -> inf or NaN."""
    int_dtype, mask = _EXPONENT_BITS[t.dtype]
    t = t.clone()
    with torch.no_grad():
        t.view(-1)[:1].view(int_dtype).bitwise_or_(mask)
    return t


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    global _calls
    _calls += 1
    x, y = batch
    logits = model(x)
    if _calls == GLITCH_ON_CALL:
        logits = _flip_exponent_bits(logits)
    return F.cross_entropy(logits, y)


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    batches = []
    for _ in range(N_STEPS):
        x = torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        batches.append((x, (x @ w).argmax(-1)))
    return batches


def target():
    torch.manual_seed(0)
    model = Classifier()
    return {
        "model": model,
        "loss_fn": loss_fn,
        "batches": make_batches(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
