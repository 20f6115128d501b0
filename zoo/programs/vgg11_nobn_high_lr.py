"""torchvision's VGG-11 (configuration "A", no BatchNorm) trained with SGD momentum 0.9 and a warm-up to a too-high peak LR.

Source: https://github.com/pytorch/vision, torchvision/models/vgg.py, commit 02196ff416e2ccfe1127d1c1a8745e47afa2fd93, license BSD-3-Clause.
Changed: ImageNet is replaced by scikit-learn's bundled 8x8 digits upsampled to 32x32 (grey copied to the 3
input channels; 1500 train, 297 held out); cfg "A" channels narrowed 4x (16-32-64-64-128-128-128-128), the
classifier's 4096 -> 256 and 1000 -> 10 classes (make_layers, VGG, _initialize_weights, avgpool (7, 7) and
dropout as in the file); SGD momentum 0.9, batch 64, cross-entropy; LambdaLR: LR 0.02 for 200 steps, then a
linear warm-up to a peak of 0.2 over 100 steps (the run ends at the peak); 300 steps.
Kind: trajectory. Without BatchNorm the deep ReLU stack learns slowly at LR 0.02 (loss level 2.30 until step
~100, 0.90 at step 217). As the warm-up raises the LR past 0.05 (2.5x, step 216) the network breaks: the
last conv's (features.18) largest held-out activation drops from 3-9 to 0.68 (step 219), the loss level
climbs 0.90 -> 1.29 (step 222) -> 2.30 (chance, step ~238) and stays there to the end (held-out CE 2.30 ->
2.31). Peak LR 0.02 (held-out 0.58) and clip_grad_norm_ 1.0 (0.64) both hold.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 300
KIND = "trajectory"
FIXES = {"lr": "peak LR 0.02 instead of 0.2 (the warm-up then keeps the base LR 0.02)",
         "clip": "clip_grad_norm_(model.parameters(), 1.0) before each SGD step (schedule unchanged)"}
TRUTH = {"cause": "lr_spike", "mechanism": "lr_schedule", "module": None, "onset": [216, 222],
         "how": "measure()'s lr_applied is 0.02 until step 200, then climbs 0.0018/step; the loss level (median "
                "of 10) reaches its best 0.90 at step 217; lr_applied passes 2.5x the base (0.0506) at step 216, "
                "features.18's largest held-out |activation| falls from 3-9 (steps 190-218) to 0.68 at step 219 "
                "(the deep layers die rather than grow: features.0 reaches 14, 3x, only later), and the loss level "
                "leaves 0.90 for 1.29 at step 222, 2.0 at 232 and chance (2.30) from ~238 on, LR 0.09 "
                "(zoo/truth/vgg11_nobn_high_lr.log)"}

BASE_LR = 0.02
PEAK_LR = 0.2
HOLD = 200     # steps at the base LR
WARMUP = 100   # linear ramp base -> peak
BATCH = 64
WIDTH = 4                                      # channel divisor (narrowed 4x)


class VGG(nn.Module):

    def __init__(
        self,
        features: nn.Module,
        num_classes: int = 1000,
        init_weights: bool = True
    ):
        super(VGG, self).__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        c = 512 // WIDTH
        h = 4096 // 16
        self.classifier = nn.Sequential(
            nn.Linear(c * 7 * 7, h),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(h, h),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(h, num_classes),
        )
        if init_weights:
            self._initialize_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x

    def _initialize_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)


def make_layers(cfg: List[Union[str, int]], batch_norm: bool = False) -> nn.Sequential:
    layers = []
    in_channels = 3
    for v in cfg:
        if isinstance(v, int):
            conv2d = nn.Conv2d(in_channels, int(v), kernel_size=3, padding=1)
            if batch_norm:
                layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
            else:
                layers += [conv2d, nn.ReLU(inplace=True)]
            in_channels = v
        else:
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
    return nn.Sequential(*layers)


cfgs: Dict[str, List[Union[str, int]]] = {
    'A': [64, 'M', 128, 'M', 256, 256, 'M', 512, 512, 'M', 512, 512, 'M'],
}


def vgg11(**kwargs) -> VGG:
    cfg = [v // WIDTH if isinstance(v, int) else v for v in cfgs['A']]   # narrowed
    return VGG(make_layers(cfg, batch_norm=False), **kwargs)


CONVS = [0, 3, 6, 8, 11, 13, 16, 18]  # features.N indices of the 8 Conv2d layers of cfg "A"


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(0)
    x, y = digits(size=32)
    x = x.expand(-1, 3, -1, -1).contiguous()   # grey -> the 3 input channels VGG expects
    x_tr, y_tr, x_va, y_va = x[:1500], y[:1500], x[1500:], y[1500:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_tr, y_tr), batch_size=BATCH, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(0))
    model = vgg11(num_classes=10)
    model.val = (x_va, y_va)
    model.act = {}
    for i in CONVS:
        model.features[i].register_forward_hook(
            lambda mod, inp, out, i=i: model.act.__setitem__(f"features.{i}", float(out.detach().abs().max())))
    peak = 0.02 if fix == "lr" else PEAK_LR
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)

    def factor(step):  # LambdaLR: hold the base LR, then a linear warm-up to the peak, then constant
        if step < HOLD:
            return 1.0
        r = min(1.0, (step - HOLD) / WARMUP)
        return (BASE_LR + r * (peak - BASE_LR)) / BASE_LR

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.opt_ref = opt
    return {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]), "batches": loader,
            "epochs": 100, "optimizer": opt, "scheduler": sched, "max_grad_norm": 1.0 if fix == "clip" else None}


def measure(model, step):
    """Truth-side precursors: each conv's largest |output| on the held-out images (forward hooks), the LR."""
    model.eval()
    v = float(F.cross_entropy(model(model.val[0][:128]), model.val[1][:128]))
    model.train()
    return {"val_loss": v, "lr_applied": model.opt_ref.param_groups[0]["lr"], **model.act}


def evaluate(model):
    """Held-out cross-entropy on the last 297 digits."""
    model.eval()
    with torch.no_grad():
        v = float(F.cross_entropy(model(model.val[0]), model.val[1]))
    model.train()
    return v


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
