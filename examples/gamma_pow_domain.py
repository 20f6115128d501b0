"""pow of a negative base: gamma correction applied to mean-subtracted images.

An image classifier starts with a ``gamma`` module that linearises sRGB pixel
values with ``x.pow(1 / 2.2)``, which assumes pixels in [0, 1]. The data
pipeline, though, already applies the usual ``Normalize(mean, std)`` (ImageNet
statistics), so most pixels (about 60% here) are negative. A negative number to a
non-integer power has no real value: ``pow`` returns NaN for every one of them,
at the very first step, in fp32. Applying the gamma before normalising (or
``x.clamp(min=0).pow(...)``) avoids it.

Expected diagnosis: cause ``domain``, phase ``forward``, module ``gamma``
(``aten.pow`` with a negative base), step 0, every sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

N_CLASSES, BATCH_SIZE, N_STEPS, SIZE = 5, 8, 20, 16
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


@dataclass
class ImageBatch:
    images: torch.Tensor  # (B, 3, H, W), normalised with MEAN/STD
    labels: torch.Tensor  # (B,)


class GammaCorrection(nn.Module):
    def __init__(self, gamma: float = 2.2):
        super().__init__()
        self.gamma = gamma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(1 / self.gamma)


class SmallConvNet(nn.Module):
    def __init__(self, n_classes: int = N_CLASSES):
        super().__init__()
        self.gamma = GammaCorrection(2.2)
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Linear(32, n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(self.gamma(images)))


def make_batches(seed: int = 0) -> list[ImageBatch]:
    g = torch.Generator().manual_seed(seed)
    tints = torch.rand(N_CLASSES, 3, 1, 1, generator=g)  # each class has its own colour cast
    batches = []
    for _ in range(N_STEPS):
        labels = torch.randint(0, N_CLASSES, (BATCH_SIZE,), generator=g)
        pixels = (0.6 * tints[labels] + 0.4 * torch.rand(BATCH_SIZE, 3, SIZE, SIZE, generator=g))
        images = (pixels - MEAN) / STD  # torchvision.transforms.Normalize(MEAN, STD)
        batches.append(ImageBatch(images, labels))
    return batches


def classification_loss(model: nn.Module, batch: ImageBatch) -> torch.Tensor:
    return F.cross_entropy(model(batch.images), batch.labels)


def target():
    torch.manual_seed(0)
    model = SmallConvNet()
    return {
        "model": model,
        "loss_fn": classification_loss,
        "batches": make_batches(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        "precision": "fp32",
    }


if __name__ == "__main__":
    from plain_loop import train

    train(target())
