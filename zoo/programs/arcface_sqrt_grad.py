"""ronghuaiyang/arcface-pytorch's ArcMarginProduct head (ArcFace) trained with focal loss on a small LeNet backbone.

Source: https://github.com/ronghuaiyang/arcface-pytorch, models/metrics.py + models/focal_loss.py + train.py, commit 47ace80b128042cd8d2efd408f55c5a3e156b032, license NOASSERTION (the repository has no LICENSE file).
Changed: CASIA-WebFace (a download) and resnet_face18 are replaced by scikit-learn's bundled 8x8 digits and a
LeNet-style backbone with a 2-dimensional ReLU embedding (LeNet, as in issue 32); ArcMarginProduct's
one_hot is made on the input's device instead of 'cuda'; optimizer SGD lr 0.1, weight decay 5e-4 (the repo's
config), FocalLoss(gamma=2), batch 64.
Kind: broken. ArcMarginProduct computes sine = sqrt((1 - cosine^2).clamp(0, 1)); once an embedding lines up
exactly with a class weight, cosine rounds to 1.0, the sqrt's argument is exactly 0 and its backward is
inf; multiplied by the zero one-hot gradient it gives NaN in metric_fc's backward. Here 831 training-set
cosines are exactly +-1.0 after step 6 (none before) and step 7's gradients are NaN while its loss (16.8) is
finite. Clamping the argument away from 0 (issue 91) holds (final level 6.04).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import Parameter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 300
KIND = "broken"
FIXES = {"clamp_eps": "sine = sqrt((1 - cosine^2).clamp(1e-6, 1)) (issue 91's fix)"}
TRUTH = {"cause": "sqrt", "mechanism": None, "module": "metric_fc", "onset": None,
         "how": ('Public report: https://github.com/ronghuaiyang/arcface-pytorch/issues/91 (also issue 32: loss NaN '
                 "after several batches; fix clamps sqrt's argument away from 0). Op: sine = torch.sqrt((1.0 - "
                 "torch.pow(cosine, 2)).clamp(0, 1)) in ArcMarginProduct.forward. measure's n_cosine_eq_1 is 0 through "
                 'step 5 and 831 after step 6 (max_abs_cosine exactly 1.0): the argument is exactly 0, and at step 7 '
                 'SqrtBackward0 returns NaN (inf times the zero one-hot gradient; checked with '
                 'torch.autograd.detect_anomaly). The step-7 forward loss (16.8) is finite.')}
FEAT = 2


class ArcMarginProduct(nn.Module):
    r"""Implement of large margin arc distance: :
        Args:
            in_features: size of each input sample
            out_features: size of each output sample
            s: norm of input feature
            m: margin

            cos(theta + m)
        """
    def __init__(self, in_features, out_features, s=30.0, m=0.50, easy_margin=False, eps=0.0):
        super(ArcMarginProduct, self).__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.s = s
        self.m = m
        self.weight = Parameter(torch.FloatTensor(out_features, in_features))
        nn.init.xavier_uniform_(self.weight)

        self.easy_margin = easy_margin
        self.cos_m = math.cos(m)
        self.sin_m = math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m
        self.eps = eps

    def forward(self, input, label):
        # --------------------------- cos(theta) & phi(theta) ---------------------------
        cosine = F.linear(F.normalize(input), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - torch.pow(cosine, 2)).clamp(self.eps, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        if self.easy_margin:
            phi = torch.where(cosine > 0, phi, cosine)
        else:
            phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        # --------------------------- convert label to one-hot ---------------------------
        one_hot = torch.zeros(cosine.size(), device=input.device)
        one_hot.scatter_(1, label.view(-1, 1).long(), 1)
        output = (one_hot * phi) + ((1.0 - one_hot) * cosine)
        output *= self.s
        return output


class FocalLoss(nn.Module):

    def __init__(self, gamma=0, eps=1e-7):
        super(FocalLoss, self).__init__()
        self.gamma = gamma
        self.eps = eps
        self.ce = torch.nn.CrossEntropyLoss()

    def forward(self, input, target):
        logp = self.ce(input, target)
        p = torch.exp(-logp)
        loss = (1 - p) ** self.gamma * logp
        return loss.mean()


class LeNet(nn.Module):
    def __init__(self, feat=FEAT):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, feat)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.relu(self.fc2(x))


class FaceModel(nn.Module):
    def __init__(self, eps=0.0):
        super().__init__()
        self.backbone = LeNet()
        self.metric_fc = ArcMarginProduct(FEAT, 10, s=30, m=0.5, easy_margin=False, eps=eps)


criterion = FocalLoss(gamma=2)


def loss_fn(model, batch):
    data_input, label = batch
    feature = model.backbone(data_input)
    output = model.metric_fc(feature, label)
    return criterion(output, label)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(0)
    x, y = digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:1500], y[:1500]), batch_size=64,
                                         shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))
    model = FaceModel(eps=1e-6 if fix == "clamp_eps" else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=5e-4)
    return {"model": model, "loss_fn": loss_fn, "batches": loader, "epochs": 20, "optimizer": opt}


def measure(model, step):
    """Largest |cosine| between a training embedding and a class weight (1.0 exactly is the sqrt's edge)."""
    x, _ = digits()
    cosine = F.linear(F.normalize(model.backbone(x[:1500])), F.normalize(model.metric_fc.weight))
    return {"max_abs_cosine": float(cosine.abs().max()), "n_cosine_eq_1": float((cosine.abs() == 1.0).sum())}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
