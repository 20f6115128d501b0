"""pytorch/tutorials transfer learning (resnet ``fc`` replaced, SGD momentum 0.9) fine-tuned with ULMFiT-style gradual unfreezing.

Source: https://github.com/pytorch/tutorials, beginner_source/transfer_learning_tutorial.py, commit 74ba612b95095bf8f77828989e9cdac609d2bd1b, license BSD-3-Clause.
Changed: the ImageNet-pretrained torchvision resnet18 and the hymenoptera data (downloads) are replaced by a
small resnet-shaped net (conv1/bn1, layer1-3 of BasicBlocks, fc; widths 16/16/32/64) "pretrained" inside
target() for 120 Adam steps on scikit-learn digits (16x16; 900 images, which digit), then fine-tuned on 500
other images for another task (the digit mod 3) with a new ``fc`` (the tutorial's model_ft.fc =
nn.Linear(num_ftrs, n)); 397 images held out; the tutorial's two recipes (fixed feature
extractor with requires_grad=False, then all layers) are combined into gradual unfreezing as in ULMFiT
(Howard & Ruder 2018): head only for 60 steps, then every 60 steps the next layer group from the top
(layer3, layer2, layer1, conv1+bn1) gets requires_grad=True and is added to the SGD optimizer as a new param
group with the head's lr (SGD lr 0.05, momentum 0.9 as the tutorial; no discriminative lr, DISC = 1);
batch 32; StepLR omitted; 300 steps.
Kind: healthy. The head alone takes the loss 1.12 -> a level 0.13 (step 59); unfreezing layer3 (step 60) helps
at once (level 0.016 by step 119), but each later unfreeze, with the head's lr on pretrained weights, knocks
the loss back up before it falls again: layer2 (step 120) 0.016 -> 0.155 at step 167, layer1 (step 180)
0.093 -> 0.176 at step 194, conv1+bn1 (step 240) 0.043 -> 0.138 at step 255; final level 0.019.
Held-out accuracy on the target task 33.8% -> 98.0%.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 300
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None,
         "how": "measured (zoo/truth/finetune_gradual_unfreeze.log, loss level = running median of 10): head only "
                "1.12 -> 0.13 (step 59); after unfreezing layer3 (step 60) 0.016 by step 119; each later unfreeze "
                "(a new SGD param group) raises the level ~3-10x and it falls again: layer2 @120 0.016 -> 0.155 "
                "(step 167) -> 0.093, layer1 @180 0.093 -> 0.176 (step 194) -> 0.043, stem @240 0.043 -> 0.138 "
                "(step 255) -> final 0.019; single steps up to 0.74. Held-out accuracy 33.8% -> 98.0%. Finite throughout."}

LR, DISC, STAGE, BATCH, PRETRAIN_STEPS = 0.05, 1.0, 60, 32, 120
GROUPS = ["layer3", "layer2", "layer1", "stem"]   # unfrozen top-down, one every STAGE steps


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    """A resnet18-shaped net, shrunk: same module names (conv1, bn1, layer1.., fc)."""

    def __init__(self, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.layer3 = BasicBlock(32, 64, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def group(self, name):
        if name == "stem":
            return list(self.conv1.parameters()) + list(self.bn1.parameters())
        return list(getattr(self, name).parameters())


def _data():
    x, y = digits(size=16)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    # source task: which digit (10 classes) on 900 images; target task: the digit mod 3 (3 classes) on
    # 500 other images, the remaining 397 held out
    return x[:900], y[:900], x[900:1400], y[900:1400] % 3, x[1400:], y[1400:] % 3


XS, YS, XT, YT, XV, YV = _data()
criterion = nn.CrossEntropyLoss()


def evaluate(model) -> float:
    """Held-out accuracy (%) on the target task (digits 5-9)."""
    model.eval()
    with torch.no_grad():
        acc = 100.0 * float((model(XV).argmax(1) == YV).float().mean())
    model.train()
    return acc


def target(config=None):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    # "pretraining" on the source task (digits 0-4)
    model = ResNet(num_classes=10)
    popt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(PRETRAIN_STEPS):
        idx = torch.randint(0, len(YS), (64,), generator=g)
        popt.zero_grad()
        criterion(model(XS[idx]), YS[idx]).backward()
        popt.step()
    # transfer: a new fc (the tutorial's model_ft.fc = nn.Linear(num_ftrs, n)); freeze everything else
    for param in model.parameters():
        param.requires_grad = False
    num_ftrs = model.fc.in_features
    model.fc = nn.Linear(num_ftrs, 3)
    optimizer = torch.optim.SGD(model.fc.parameters(), lr=LR, momentum=0.9)
    model.train()

    def batches(step):
        idx = torch.randint(0, len(YT), (BATCH,), generator=g)
        return XT[idx], YT[idx]

    def step_fn(model, batch, step):
        if step > 0 and step % STAGE == 0 and step // STAGE <= len(GROUPS):
            k = step // STAGE
            params = model.group(GROUPS[k - 1])
            for p in params:
                p.requires_grad = True
            optimizer.add_param_group({"params": params, "lr": LR / DISC ** k})
        inputs, labels = batch
        optimizer.zero_grad()
        loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()
        return {"loss": loss, "trainable_groups": torch.tensor(float(len(optimizer.param_groups)))}

    return {"model": model, "step_fn": step_fn, "batches": batches, "optimizer": optimizer}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
