"""pytorch/examples DCGAN (Generator / Discriminator, BCELoss, Adam 2e-4, betas (0.5, 0.999)) on 16x16 digits.

Source: https://github.com/pytorch/examples, dcgan/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: MNIST (a download) is replaced by scikit-learn's bundled 8x8 digits upsampled to 16x16 and
normalised to [-1, 1] like the example's Normalize((0.5,), (0.5,)) (1497 train, 300 held out for
evaluate); imageSize 64 -> 16, so Generator and Discriminator keep the example's layer pattern
(ConvTranspose2d/BatchNorm2d/ReLU ... Tanh; Conv2d/LeakyReLU(0.2)/BatchNorm2d ... Sigmoid) with one
stride-2 stage fewer each side (4x4 -> 8x8 -> 16x16), nz 100 -> 32, ngf = ndf = 16; weights_init, BCELoss,
real_label 1 / fake_label 0, the D update (real + fake.detach()) then the G update (fake labelled real) and
both Adam(lr 2e-4, betas (0.5, 0.999)) are the example's; batch 64, 600 steps (one step = one D and one G
update, as one iteration of the example's inner loop). The two nets sit in a DCGAN container module.
Kind: healthy. As D improves (errD level 1.27 early -> 0.81 at the end, D(G(z)) 0.54 -> 0.34) the G loss
rises and oscillates: errG level 0.61 (step 23) -> 1.19 at the end, single batches up to 1.71 (step 558);
the summed loss errD + errG climbs from its best level 1.65 (step 37) to 1.99 (+21%). The generator still
learns: the pixel-space Frechet distance to held-out digits (evaluate) goes 66.1 -> 6.4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 600
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None, "how": ("adversarial dynamics: errG level rises 0.61 -> 1.19 (single batches up to 1.71) and errD + errG "
                "from its best level 1.65 to 1.99 (+21%) as D sharpens (errD 1.27 -> 0.81, D(G(z)) 0.54 -> "
                "0.34); samples improve: pixel-PCA Frechet distance to held-out digits 66.1 -> 6.4; all finite")}

nz = 32
ngf = 16
ndf = 16
nc = 1
lr = 0.0002
beta1 = 0.5
batchSize = 64


# custom weights initialization called on netG and netD
def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 4 x 4
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 8 x 8
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh()
            # state size. (nc) x 16 x 16
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()
        self.main = nn.Sequential(
            # input is (nc) x 16 x 16
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 8 x 8
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 4 x 4
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid()
        )

    def forward(self, input):
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


class DCGAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.netG = Generator()
        self.netG.apply(weights_init)
        self.netD = Discriminator()
        self.netD.apply(weights_init)


def _split():
    x, _ = digits(size=16, normalize=(0.5, 0.5))  # the example's Normalize((0.5,), (0.5,)): [0, 1] -> [-1, 1]
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm[300:]], x[perm[:300]]


def target(config=None):
    torch.manual_seed(999)
    train_x, _ = _split()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train_x), batch_size=batchSize,
                                         shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(999))
    model = DCGAN()
    netG, netD = model.netG, model.netD
    criterion = nn.BCELoss()
    real_label = 1
    fake_label = 0
    optimizerD = optim.Adam(netD.parameters(), lr=lr, betas=(beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=lr, betas=(beta1, 0.999))

    def step_fn(model, data, step):
        ############################
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        ###########################
        # train with real
        netD.zero_grad()
        real_cpu = data[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)

        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean()

        # train with fake
        noise = torch.randn(batch_size, nz, 1, 1)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean()
        errD = errD_real + errD_fake
        optimizerD.step()

        ############################
        # (2) Update G network: maximize log(D(G(z)))
        ###########################
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        optimizerG.step()
        return {"loss": (errD + errG).detach(), "errD": errD.detach(), "errG": errG.detach(),
                "D_x": D_x.detach(), "D_G_z1": D_G_z1.detach()}

    return {"model": model, "step_fn": step_fn, "batches": loader, "epochs": 40,
            "optimizer": [optimizerD, optimizerG]}


def _frechet(a, b):
    from scipy import linalg
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def evaluate(model):
    """A pixel-space FID: Frechet distance between 300 held-out digits and 300 samples of netG, in the
    top-16 PCA components of the training digits (lower is better)."""
    train_x, test_x = _split()
    tr = train_x.view(len(train_x), -1).double()
    mean = tr.mean(0)
    _, _, v = torch.linalg.svd(tr - mean, full_matrices=False)
    proj = v[:16].T
    g = torch.get_rng_state()
    torch.manual_seed(4321)
    with torch.no_grad():
        fake = model.netG(torch.randn(300, nz, 1, 1))
    torch.set_rng_state(g)
    f = ((fake.view(300, -1).double() - mean) @ proj).numpy()
    r = ((test_x.view(300, -1).double() - mean) @ proj).numpy()
    return _frechet(r, f)


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
