"""A raise that is data: segmentation masks with the "void" label 255.

A semantic-segmentation model with 6 classes is trained on masks exported
from an annotation tool that marks unlabelled pixels (object borders) with
255, the usual "void" value. The loss is ``F.cross_entropy(logits, mask)``
without ``ignore_index=255``: the first mask with a void pixel makes
cross_entropy raise ``IndexError: Target 255 is out of bounds`` before any
NaN exists. The fix is to ignore 255, not to clean it away.

Expected diagnosis: cause ``data`` (label out of range), phase ``input``,
step 1, key ``batch['mask']``; the fix passes ``ignore_index=255``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_CLASSES, SIZE, BATCH_SIZE, N_STEPS, VOID = 6, 12, 4, 6, 255


class SegNet(nn.Module):
    def __init__(self, n_classes: int = N_CLASSES):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, n_classes, 1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(N_STEPS):
        image = torch.randn(BATCH_SIZE, 3, SIZE, SIZE, generator=g)
        mask = (image[:, 0] > 0).long() + 2 * (image[:, 1] > 0.5).long()        # classes 0..3
        if step >= 1:                                   # the annotated part of the set: borders are void
            mask[2, 5, :] = VOID
        batches.append({"image": image, "mask": mask})
    return batches


def seg_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["image"]), batch["mask"])      # BUG: no ignore_index=255


def target():
    torch.manual_seed(0)
    model = SegNet()
    return {"model": model, "loss_fn": seg_loss, "batches": make_batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.05), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
