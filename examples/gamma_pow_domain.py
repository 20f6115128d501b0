"""Domain error: gamma correction x ** (1/2.2) applied after mean/std normalization.

An image model applies a gamma curve in its ``gamma`` module. The images were already normalized
to zero mean, so about half the pixels are negative, and a fractional power of a negative base is
NaN in the forward pass.

Expected diagnosis: domain, forward, module ``gamma`` (aten.pow).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Gamma(nn.Module):
    def __init__(self, gamma: float = 2.2):
        super().__init__()
        self.gamma = gamma

    def forward(self, x):
        return x.pow(1.0 / self.gamma)


class TinyCNN(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.gamma = Gamma()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(8, classes)

    def forward(self, images):
        return self.classifier(self.features(self.gamma(images)))


def make_batches(steps: int = 4):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        images = torch.rand(4, 3, 8, 8, generator=g)
        images = (images - images.mean()) / images.std()   # normalized in the data pipeline
        out.append({"images": images, "labels": torch.randint(0, 5, (4,), generator=g)})
    return out


def target():
    torch.manual_seed(0)
    model = TinyCNN()
    return {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b["images"]), b["labels"]),
            "batches": make_batches(), "optimizer": torch.optim.SGD(model.parameters(), lr=0.01)}
