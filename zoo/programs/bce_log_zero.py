"""wiseodd/generative-models' vanilla GAN (PyTorch) with the hand-written GAN loss -mean(log D(x) + log(1 - D(G(z)))).

Source: https://github.com/wiseodd/generative-models, GAN/vanilla_gan/gan_pytorch.py (model, Adam 1e-3, loop) and GAN/vanilla_gan/gan_tensorflow.py lines 77-78 (the hand-written loss, there commented out), commit b930d5fa9e2f69adfd4ea8ec759f38f6ce6da4c2, license Unlicense.
Changed: MNIST (a download) is replaced by scikit-learn's bundled 8x8 digits normalised with MNIST's
(0.1307, 0.3081) as torchvision users do (X_dim 64; the generator's sigmoid output cannot reach the real
range, so the discriminator wins easily); Z_dim 16, h_dim 128, mb_size 64; the file's
nn.binary_cross_entropy(D, label) calls are written out by hand with no clamp or epsilon,
-mean(y log p + (1 - y) log(1 - p)), the formula of the repository's TensorFlow twin (lines 77-78).
Kind: broken. D(X) ends in a sigmoid; once the discriminator's logit for a real digit passes 16.64 the
float32 sigmoid is exactly 1.0 (after step 131 here), and when that digit is drawn (step 138) the term
(1 - y) * log(1 - p) is 0 * log(0) = 0 * -inf = NaN. The repository's own log(x + 1e-8) keeps the run finite
for all 400 steps, but measure_truth does not count it as holding: the summed GAN loss level rises as the
discriminator wins (5.4 against a best of 1.64), which is GAN dynamics, not a failure of the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 400
KIND = "broken"
FIXES = {"eps": "log(x + 1e-8), the epsilon the repository's other GANs use"}
TRUTH = {"cause": "log", "mechanism": None, "module": "(loss_fn)", "onset": None,
         "how": ('Public reports: https://github.com/torch/nn/issues/730 (BCE on sigmoid outputs: a probability of '
                 'exactly 1 makes log(1 - 1) = -inf) and https://ai.stackexchange.com/questions/6622 (sigmoid + '
                 'cross-entropy, log(0)). Op: (1 - y) * torch.log(1 - p) with y = 1 and p = D_real == 1.0 gives 0 * '
                 "-inf = NaN. measure: the discriminator's largest real logit passes 16.64 (where float32 sigmoid "
                 'rounds to exactly 1.0) after step 131 (real_logit_max 16.60 -> 16.67, n_real_sigmoid_eq_1 0 -> 1 '
                 'from step 132); that sample is drawn at step 138 and D_loss is NaN.')}

mb_size, Z_dim, h_dim, X_dim = 64, 16, 128, 64


def xavier_init(size):
    in_dim = size[0]
    xavier_stddev = 1. / np.sqrt(in_dim / 2.)
    return nn.Parameter(torch.randn(*size) * xavier_stddev)


class GAN(nn.Module):
    """The file's free tensors (Wzh, bzh, Whx, bhx / Wxh, bxh, Why, bhy) gathered in two modules."""

    def __init__(self):
        super().__init__()
        self.G = nn.ParameterDict(dict(Wzh=xavier_init([Z_dim, h_dim]), bzh=nn.Parameter(torch.zeros(h_dim)),
                                       Whx=xavier_init([h_dim, X_dim]), bhx=nn.Parameter(torch.zeros(X_dim))))
        self.D = nn.ParameterDict(dict(Wxh=xavier_init([X_dim, h_dim]), bxh=nn.Parameter(torch.zeros(h_dim)),
                                       Why=xavier_init([h_dim, 1]), bhy=nn.Parameter(torch.zeros(1))))

    def gen(self, z):
        p = self.G
        h = F.relu(z @ p["Wzh"] + p["bzh"].repeat(z.size(0), 1))
        X = torch.sigmoid(h @ p["Whx"] + p["bhx"].repeat(h.size(0), 1))
        return X

    def disc(self, X):
        p = self.D
        h = F.relu(X @ p["Wxh"] + p["bxh"].repeat(X.size(0), 1))
        y = torch.sigmoid(h @ p["Why"] + p["bhy"].repeat(h.size(0), 1))
        return y


def target(config=None):
    fix = (config or {}).get("fix")
    eps = 1e-8 if fix == "eps" else 0.0
    torch.manual_seed(0)
    data = digits()[0].reshape(-1, X_dim)   # normalised with MNIST's (0.1307, 0.3081), as torchvision users do
    model = GAN()
    G_solver = optim.Adam(model.G.parameters(), lr=1e-3)
    D_solver = optim.Adam(model.D.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def batches(it):
        idx = torch.randint(0, len(data), (mb_size,), generator=gen)
        z1 = torch.randn(mb_size, Z_dim, generator=gen)
        z2 = torch.randn(mb_size, Z_dim, generator=gen)
        return data[idx], z1, z2

    def binary_cross_entropy(p, y):
        """nn.binary_cross_entropy written out by hand (no clamp): -mean(y log p + (1 - y) log(1 - p))."""
        return -torch.mean(y * torch.log(p + eps) + (1 - y) * torch.log(1 - p + eps))

    ones_label = torch.ones(mb_size, 1)
    zeros_label = torch.zeros(mb_size, 1)

    def step_fn(model, batch, it):
        X, z, z2 = batch
        # Dicriminator forward-loss-backward-update
        G_sample = model.gen(z)
        D_real = model.disc(X)
        D_fake = model.disc(G_sample)
        D_loss_real = binary_cross_entropy(D_real, ones_label)
        D_loss_fake = binary_cross_entropy(D_fake, zeros_label)
        D_loss = D_loss_real + D_loss_fake
        D_solver.zero_grad()
        G_solver.zero_grad()
        D_loss.backward()
        D_solver.step()
        # Generator forward-loss-backward-update
        G_sample = model.gen(z2)
        D_fake = model.disc(G_sample)
        G_loss = binary_cross_entropy(D_fake, ones_label)
        D_solver.zero_grad()
        G_solver.zero_grad()
        G_loss.backward()
        G_solver.step()
        return {"loss": D_loss.detach() + G_loss.detach(), "D_loss": D_loss.detach(), "G_loss": G_loss.detach()}

    return {"model": model, "step_fn": step_fn, "batches": batches, "optimizer": [D_solver, G_solver]}


def measure(model, step):
    """The discriminator's extreme logits on fresh fakes (sigmoid is exactly 0 below about -103.9, 1 above 16.6)."""
    g = torch.Generator().manual_seed(123)
    z = torch.randn(256, Z_dim, generator=g)
    p = model.D
    h = F.relu(model.gen(z) @ p["Wxh"] + p["bxh"])
    logit = h @ p["Why"] + p["bhy"]
    hr = F.relu(digits()[0].reshape(-1, X_dim) @ p["Wxh"] + p["bxh"])
    real = hr @ p["Why"] + p["bhy"]
    return {"fake_logit_min": float(logit.min()), "fake_logit_max": float(logit.max()),
            "real_logit_max": float(real.max()), "n_real_sigmoid_eq_1": float((torch.sigmoid(real) == 1.0).sum())}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
