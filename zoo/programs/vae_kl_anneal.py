"""pytorch/examples MLP VAE on 8x8 digits with linear KL annealing (Bowman et al. 2016).

Source: https://github.com/pytorch/examples, vae/main.py, commit 77f55b912142e11fcfdf5b530231fb9c52f181e8, license BSD-3-Clause.
Changed: MNIST (a download) is replaced by scikit-learn's bundled 8x8 digits in [0, 1] (1497 train, 300
held out), flattened to 64 inputs (784 -> 64, hidden 400 -> 128, latent 20 kept); the example's
loss_function (BCE summed + KLD) is kept but divided by the batch size and the KL term is weighted by
beta: 0 for DELAY steps, then ramped linearly 0 -> 1 over ANNEAL steps (the KL annealing of Bowman et al.,
"Generating Sentences from a Continuous Space", 2016); Adam lr 1e-3 as in the example, batch 128, 800 steps.
Kind: healthy. beta stays 0 for 150 steps, then ramps to 1 by step 450: the train loss level (median of
10) climbs 17% from its best 21.6 at step 150 to 25.1-25.6 and never returns, while the per-image KL falls
from ~90 to ~2.8 nats; the held-out negative ELBO goes 44.8 (init) -> 112.2 (step 150, beta 0) -> 25.0 (end).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.utils.data
from torch import nn, optim
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 800
DELAY = 150
ANNEAL = 300
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None, "how": ("train loss level rises 17% (best 21.6 at step 150 -> final 25.1) while the KL weight ramps "
                "0->1 over steps 150-450 (KL 90 -> 2.8 nats/image); held-out negative ELBO 44.8 -> 25.0 "
                "(112.2 at step 150); finite throughout")}

D_IN = 64


class VAE(nn.Module):
    def __init__(self):
        super(VAE, self).__init__()

        self.fc1 = nn.Linear(D_IN, 128)
        self.fc21 = nn.Linear(128, 20)
        self.fc22 = nn.Linear(128, 20)
        self.fc3 = nn.Linear(20, 128)
        self.fc4 = nn.Linear(128, D_IN)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5*logvar)
        eps = torch.randn_like(std)
        return mu + eps*std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, D_IN))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


# Reconstruction + KL divergence losses summed over all elements and batch
def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, D_IN), reduction='sum')
    # see Appendix B from VAE paper: 0.5 * sum(1 + log(sigma^2) - mu^2 - sigma^2)
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE, KLD


def _data():
    x, _ = digits(normalize=(0.0, 1.0))
    x = x.view(-1, D_IN)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm[300:]], x[perm[:300]]


def beta_at(step):
    return min(1.0, max(0.0, (step - DELAY) / ANNEAL))


def target(config=None):
    torch.manual_seed(1)
    train_x, _ = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train_x), batch_size=128, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(1))
    model = VAE()
    optimizer = optim.Adam(model.parameters(), lr=1e-3)

    def step_fn(model, batch, step):
        (data,) = batch
        model.train()
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        bce, kld = loss_function(recon_batch, data, mu, logvar)
        loss = (bce + beta_at(step) * kld) / len(data)
        loss.backward()
        optimizer.step()
        return {"loss": loss, "recon": bce / len(data), "kl": kld / len(data)}

    return {"model": model, "step_fn": step_fn, "batches": loader, "epochs": 100, "optimizer": optimizer}


def measure(model, step):
    """The KL weight applied at this step."""
    return {"beta": beta_at(step)}


def evaluate(model):
    """Held-out negative ELBO per image (BCE + full KL, beta = 1) on the 300 held-out digits."""
    _, test_x = _data()
    model.eval()
    g = torch.get_rng_state()
    torch.manual_seed(123)
    with torch.no_grad():
        recon, mu, logvar = model(test_x)
        bce, kld = loss_function(recon, test_x, mu, logvar)
    torch.set_rng_state(g)
    model.train()
    return float((bce + kld) / len(test_x))


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
