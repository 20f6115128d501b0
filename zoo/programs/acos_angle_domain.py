"""sthalles/SimCLR's info_nce_loss with an angular margin on the positive pair (theta = acos(cosine)), no clamp.

Source: https://github.com/sthalles/SimCLR, simclr.py (info_nce_loss, Adam 3e-4, wd 1e-4, temperature 0.07) + models/resnet_simclr.py (backbone + MLP projection head), commit 1848fc934ad844ae630e6c452300433fe99acfd9, license MIT.
Changed: STL10 (a download) and torchvision's resnet18 are replaced by scikit-learn's bundled 8x8 digits
and a small CNN with ResNetSimCLR's MLP head (out_dim 32); the view generator makes two views by a random
shift of up to 3 pixels (49 possible views, so two views of one image are sometimes identical); batch 32
images x 2 views; the positive logits get an additive angular margin, positives = cos(acos(positives) + m)
with m 0.1 (the ArcCon/ArcCSE variant of InfoNCE users bolt onto this loss), computed without a clamp.
Kind: broken. When both views of an image are the same shift the two embeddings are bitwise identical and
their cosine, a rounded dot product of two unit vectors, comes out a hair above 1.0 (about a quarter of
such pairs); acos is outside its domain there and returns NaN in the loss, first at step 9 (QData/TextAttack
PR 804 is the same rounding in an acos of cosine similarity). Clamping the cosine to [-1 + 1e-7, 1 - 1e-7]
holds (final level 4.24).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 150
KIND = "broken"
FIXES = {"clamp": "theta = torch.acos(positives.clamp(-1 + 1e-7, 1 - 1e-7))"}
TRUTH = {"cause": "domain", "mechanism": None, "module": "(loss_fn)", "onset": None,
         "how": ('Public report: https://github.com/QData/TextAttack/pull/804 (cosine similarity of two identical '
                 'embeddings comes out slightly above 1 and torch.acos returns NaN; see also '
                 'https://github.com/pytorch/pytorch/issues/18057). Op: theta = torch.acos(positives) in '
                 "info_nce_loss: at step 9 one image's two views are the same shift, the positive cosine of the two "
                 'identical embeddings rounds above 1.0 and acos returns NaN in the forward loss (4.51 at step 8, NaN '
                 'at step 9).')}


class Args:
    batch_size = 32
    n_views = 2
    temperature = 0.07
    margin = 0.1
    device = "cpu"


class SmallCNN(nn.Module):
    """Stands in for torchvision's resnet18 (num_classes=out_dim): conv features, then ``fc``."""

    def __init__(self, num_classes=32):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 2 * 2, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


class ResNetSimCLR(nn.Module):

    def __init__(self, out_dim=32):
        super(ResNetSimCLR, self).__init__()
        self.backbone = SmallCNN(num_classes=out_dim)
        dim_mlp = self.backbone.fc.in_features
        # add mlp projection head
        self.backbone.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.backbone.fc)

    def forward(self, x):
        return self.backbone(x)


def make_info_nce_loss(args, clamp=False):
    def info_nce_loss(features):
        labels = torch.cat([torch.arange(args.batch_size) for i in range(args.n_views)], dim=0)
        labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
        features = F.normalize(features, dim=1)
        similarity_matrix = torch.matmul(features, features.T)
        # discard the main diagonal from both: labels and similarities matrix
        mask = torch.eye(labels.shape[0], dtype=torch.bool)
        labels = labels[~mask].view(labels.shape[0], -1)
        similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
        # select and combine multiple positives
        positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
        # added: additive angular margin on the positive pair (ArcCon-style)
        if clamp:
            positives = positives.clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(positives)
        positives = torch.cos(theta + args.margin)
        # select only the negatives the negatives
        negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
        logits = torch.cat([positives, negatives], dim=1)
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        logits = logits / args.temperature
        return logits, labels
    return info_nce_loss


def target(config=None):
    fix = (config or {}).get("fix")
    args = Args()
    torch.manual_seed(0)
    x, _ = digits()
    x = x[:1500]
    padded = F.pad(x, (3, 3, 3, 3), value=float(x.min()))
    gen = torch.Generator().manual_seed(14)

    def view(idx):
        ox = torch.randint(0, 7, (len(idx),), generator=gen)
        oy = torch.randint(0, 7, (len(idx),), generator=gen)
        return torch.stack([padded[i, :, a:a + 8, b:b + 8] for i, a, b in zip(idx.tolist(), ox.tolist(), oy.tolist())])

    def batches(step):
        idx = torch.randint(0, len(x), (args.batch_size,), generator=gen)
        return torch.cat([view(idx), view(idx)], dim=0)   # n_views = 2, as ContrastiveLearningViewGenerator

    info_nce_loss = make_info_nce_loss(args, clamp=fix == "clamp")
    criterion = torch.nn.CrossEntropyLoss()

    def loss_fn(model, images):
        features = model(images)
        logits, labels = info_nce_loss(features)
        return criterion(logits, labels)

    model = ResNetSimCLR(out_dim=32)
    optimizer = torch.optim.Adam(model.parameters(), 3e-4, weight_decay=1e-4)
    return {"model": model, "loss_fn": loss_fn, "batches": batches, "optimizer": optimizer}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
