"""The masked-NaN trap: ``torch.where`` hides log(0) in the forward pass but not in the gradient.

A keyword-spotting model frames the waveform, passes each frame through a
learned filterbank (``Linear(bias=False)``), takes the energy of every filter
output and compresses it with a "safe" log in its ``safe_log`` module::

    torch.where(x > 0, torch.log(x), torch.zeros_like(x))

Clips shorter than one second are zero-padded. The first short clip arrives at
step 2 (sample 5): its padded frames are exactly zero, the filterbank output
and the energy are exactly zero, and ``log(0) = -inf`` - which ``where``
discards, so the forward pass and the loss are finite. Autograd, however,
differentiates both branches: the masked branch receives a zero gradient and
``LogBackward0`` computes 0 / 0 = NaN; ``PowBackward0`` multiplies it by the
zero frames (0 * NaN = NaN), and the NaN lands in ``filterbank.weight``.
``torch.log(x.clamp(min=eps))`` or ``torch.log(torch.where(x > 0, x, 1))``
avoid it.

Expected diagnosis: cause ``log``, phase ``forward`` (born in the masked
``aten.log`` of ``safe_log``; it shows up first in the gradients), module
``safe_log``, step 2, sample 5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_RATE, FRAME, HOP, N_FILTERS, N_CLASSES, BATCH_SIZE, N_STEPS = 1600, 64, 32, 16, 3, 8, 20


class SafeLog(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


class KeywordSpotter(nn.Module):
    def __init__(self, n_classes: int = N_CLASSES):
        super().__init__()
        self.filterbank = nn.Linear(FRAME, N_FILTERS, bias=False)
        self.safe_log = SafeLog()
        self.classifier = nn.Sequential(nn.Linear(N_FILTERS, 32), nn.ReLU(), nn.Linear(32, n_classes))

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        frames = audio.unfold(-1, FRAME, HOP)              # (B, n_frames, FRAME)
        energy = self.filterbank(frames) ** 2               # (B, n_frames, N_FILTERS)
        features = self.safe_log(energy).mean(dim=1)        # average log-energy per filter
        return self.classifier(features)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """One-second clips: a class-specific tone in noise, zero-padded when the recording is short."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(SAMPLE_RATE) / SAMPLE_RATE
    batches = []
    for step in range(N_STEPS):
        label = torch.randint(0, N_CLASSES, (BATCH_SIZE,), generator=g)
        freq = 100.0 * (label + 1).float()[:, None]
        audio = torch.sin(2 * torch.pi * freq * t) + 0.3 * torch.randn(BATCH_SIZE, SAMPLE_RATE, generator=g)
        if step == 2:
            audio[5, 1000:] = 0.0  # a 0.6 s recording, zero-padded to one second
        batches.append({"audio": audio, "label": label})
    return batches


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["audio"]), batch["label"])


def target():
    torch.manual_seed(0)
    model = KeywordSpotter()
    return {
        "model": model,
        "loss_fn": classification_loss,
        "batches": make_batches(),
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
