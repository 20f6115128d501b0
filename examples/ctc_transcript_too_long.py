"""CTC loss = inf: a transcript longer than its audio.

A small speech recogniser is trained with ``F.ctc_loss``. The acoustic model
downsamples the audio 4x, so a clip of 48 frames gives 12 output steps. One
batch holds a short clip whose transcript was mis-aligned in the manifest (it
got the next utterance's 14-character transcript). CTC needs at least as many
output steps as labels (plus one blank between repeated labels): there is no
alignment, its probability is 0 and the loss of that sample is -log 0 = inf;
the mean over the batch is inf and its gradient NaN. Nothing overflowed.

Expected diagnosis: cause ``data`` (no valid alignment), phase ``forward``,
module ``(loss_fn)``, step 3, sample 5; fix ``zero_infinity=True`` or filter
such samples - not "exceeds the float32 maximum".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_MELS, FRAMES, VOCAB, BATCH_SIZE, N_STEPS, BAD_STEP, BAD_SAMPLE = 16, 48, 12, 8, 8, 3, 5


class Recognizer(nn.Module):
    def __init__(self, n_mels: int = N_MELS, hidden: int = 32, vocab: int = VOCAB):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(n_mels, hidden, 5, stride=2, padding=2), nn.ReLU(),
                                  nn.Conv1d(hidden, hidden, 5, stride=2, padding=2), nn.ReLU())
        self.head = nn.Linear(hidden, vocab)          # class 0 is the CTC blank

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        h = self.conv(mels).transpose(1, 2)            # (B, T/4, hidden)
        return self.head(h).log_softmax(-1)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(N_STEPS):
        mels = torch.randn(BATCH_SIZE, N_MELS, FRAMES, generator=g)
        lengths = torch.randint(3, 9, (BATCH_SIZE,), generator=g)
        if step == BAD_STEP:
            lengths[BAD_SAMPLE] = 14                  # the next utterance's transcript: 14 labels, 12 steps
        targets = torch.randint(1, VOCAB, (BATCH_SIZE, 14), generator=g)
        batches.append({"mels": mels, "targets": targets, "target_lengths": lengths})
    return batches


def ctc(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    log_probs = model(batch["mels"]).transpose(0, 1)   # (T, B, vocab)
    input_lengths = torch.full((log_probs.shape[1],), log_probs.shape[0], dtype=torch.long)
    return F.ctc_loss(log_probs, batch["targets"], input_lengths, batch["target_lengths"])


def target():
    torch.manual_seed(0)
    model = Recognizer()
    return {"model": model, "loss_fn": ctc, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
