"""Real loop shapes, each as an entrypoint and as the plain loop a user would write for it.

``TARGETS[name](cfg)`` builds the target dict; ``PLAIN[name](target, steps)`` trains it for
``steps`` optimizer steps exactly as the user's own script would (no nanprobe) and returns the
state it reached (the hidden state too, where the step carries one); ``watch(step, micro, batch)``,
if given, sees each batch before the step uses it (it only reads). ``cfg`` keys: ``nan_at``
(dataset index whose features become NaN), ``labels_bad_at`` (dataset index with an out-of-range
label), ``epochs``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

D_IN = 6
CLASSES = 3


class Points(Dataset):
    """Map-style dataset of (features, label); a planted NaN or bad label at one index."""

    def __init__(self, n: int = 40, nan_at: int | None = None, labels_bad_at: int | None = None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, D_IN, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        if nan_at is not None:
            self.x[nan_at, 2] = math.nan
        if labels_bad_at is not None:
            self.y[labels_bad_at] = CLASSES + 4

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i], "index": i}


class Net(nn.Module):
    def __init__(self, hidden: int = 16, out: int = CLASSES):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D_IN, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(hidden, out)

    def forward(self, x):
        return self.head(self.encoder(x))


def ce_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


# -- 1. a shuffled DataLoader with workers, over epochs ----------------------------------------------

def shuffled(cfg=None):
    cfg = cfg or {}
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    ds = Points(n=42, nan_at=cfg.get("nan_at"), labels_bad_at=cfg.get("labels_bad_at"))
    gen = torch.Generator().manual_seed(7) if cfg.get("seeded", True) else None
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=cfg.get("workers", 2), generator=gen,
                        drop_last=True)
    return {"model": model, "loss_fn": ce_loss, "batches": loader, "optimizer": opt, "scheduler": sched,
            "epochs": cfg.get("epochs", 3), "max_grad_norm": 5.0}


def plain_shuffled(t, steps, watch=None):
    model, opt, sched, loader = t["model"], t["optimizer"], t["scheduler"], t["batches"]
    step = 0
    for _ in range(t["epochs"]):
        for batch in loader:
            if step == steps:
                return {}
            if watch:
                watch(step, 0, batch)
            opt.zero_grad(set_to_none=True)
            loss = t["loss_fn"](model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_grad_norm"])
            opt.step()
            sched.step()
            step += 1
    return {}


# -- 2. a submodule kept in eval mode --------------------------------------------------------------

def frozen_bn(cfg=None):
    cfg = cfg or {}
    torch.manual_seed(1)
    model = Net()
    model.encoder[1].eval()       # frozen BatchNorm statistics, as in fine-tuning
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ds = Points(n=32, nan_at=cfg.get("nan_at"), seed=1)
    loader = DataLoader(ds, batch_size=4, shuffle=True)
    return {"model": model, "loss_fn": ce_loss, "batches": loader, "optimizer": opt, "epochs": 2}


def plain_frozen_bn(t, steps, watch=None):
    return plain_shuffled(dict(t, scheduler=_NoSched(), max_grad_norm=1e9), steps, watch)


class _NoSched:
    def step(self):
        pass


# -- 3. fp16 + GradScaler with skipped steps and a scheduler ----------------------------------------

def fp16_scaler(cfg=None):
    cfg = cfg or {}
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(D_IN, 32), nn.ReLU(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(8, D_IN, generator=g) * 8 for _ in range(24)]
    ys = [torch.randn(8, 1, generator=g) * 8 for _ in range(24)]
    if cfg.get("nan_at") is not None:
        step, row = divmod(cfg["nan_at"], 8)
        xs[step][row, 1] = math.nan
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return {"model": model, "loss_fn": lambda m, b: F.mse_loss(m(b[0]).float(), b[1]),
            "batches": list(zip(xs, ys)), "optimizer": opt, "scheduler": sched, "precision": "fp16",
            "grad_scaler": True}


def plain_fp16_scaler(t, steps, watch=None):
    """PyTorch's AMP recipe: scale, backward, step, update, and the scheduler every iteration."""
    model, opt, sched = t["model"], t["optimizer"], t["scheduler"]
    scaler = torch.amp.GradScaler("cpu")
    skips = 0
    for step, batch in enumerate(t["batches"]):
        if step == steps:
            break
        if watch:
            watch(step, 0, batch)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = t["loss_fn"](model, batch)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skips += scaler.get_scale() < before
        sched.step()
    return {"scale": scaler.get_scale(), "skips": skips}


# -- 4. gradient accumulation, K = 4 -----------------------------------------------------------------

K = 4


def accumulate(cfg=None):
    cfg = cfg or {}
    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    ds = Points(n=40, nan_at=cfg.get("nan_at"), seed=3)
    loader = DataLoader(ds, batch_size=4, shuffle=True)      # 10 micro-batches an epoch: steps of 4, 4, 2
    return {"model": model, "loss_fn": lambda m, b: ce_loss(m, b) / K, "batches": loader, "optimizer": opt,
            "accumulate": K, "epochs": 2, "max_grad_norm": 1.0}


def plain_accumulate(t, steps, watch=None):
    model, opt, loader = t["model"], t["optimizer"], t["batches"]
    step = 0
    for _ in range(t["epochs"]):
        for i, batch in enumerate(loader):
            if step == steps:
                return {}
            if watch:
                watch(step, i % K, batch)
            loss = t["loss_fn"](model, batch)
            loss.backward()
            if (i + 1) % K == 0 or i + 1 == len(loader):   # a step never spans two epochs
                torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_grad_norm"])
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
    return {}


# -- 5. a GAN: two optimizers in the user's own step ---------------------------------------------------

def gan(cfg=None):
    cfg = cfg or {}
    torch.manual_seed(4)
    model = nn.ModuleDict({"G": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, D_IN)),
                           "D": nn.Sequential(nn.Linear(D_IN, 16), nn.LeakyReLU(0.2), nn.Dropout(0.1),
                                              nn.Linear(16, 1))})
    opt_d = torch.optim.Adam(model["D"].parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(model["G"].parameters(), lr=2e-3, betas=(0.5, 0.999))
    ds = Points(n=36, nan_at=cfg.get("nan_at"), seed=4)
    loader = DataLoader(ds, batch_size=6, shuffle=True)

    def step_fn(model, batch, step):
        G, D = model["G"], model["D"]
        real = batch["x"]
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        fake = G(torch.randn(len(real), 4))
        opt_d.zero_grad(set_to_none=True)
        loss_d = F.binary_cross_entropy_with_logits(D(real), ones) + \
            F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad(set_to_none=True)
        loss_g = F.binary_cross_entropy_with_logits(D(fake), ones)
        loss_g.backward()
        opt_g.step()
        return {"d": loss_d, "g": loss_g}

    return {"model": model, "step_fn": step_fn, "batches": loader, "optimizer": {"d": opt_d, "g": opt_g},
            "epochs": 2}


def plain_step_fn(t, steps, watch=None):
    step = 0
    for _ in range(t.get("epochs", 1)):
        for batch in t["batches"]:
            if step == steps:
                return {}
            if watch:
                watch(step, 0, batch)
            t["step_fn"](t["model"], batch, step)
            step += 1
    return {}


# -- 6. an RNN whose hidden state the step carries -------------------------------------------------------

class SeqNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(D_IN, 12, batch_first=True)
        self.head = nn.Linear(12, 1)

    def forward(self, x, h):
        out, h = self.rnn(x, h)
        return self.head(out), h


def _sequence_batches(n_steps: int, nan_at: int | None):
    """Consecutive chunks of 4 long sequences (truncated BPTT): batch k is chunk k of every sequence."""
    g = torch.Generator().manual_seed(5)
    series = torch.randn(4, n_steps * 5 + 1, D_IN, generator=g).cumsum(1) * 0.1
    chunks = []
    for k in range(n_steps):
        x = series[:, k * 5:(k + 1) * 5].clone()
        y = series[:, k * 5 + 1:(k + 1) * 5 + 1, :1].clone()
        chunks.append((x, y))
    if nan_at is not None:   # (step, sequence)
        step, row = nan_at
        chunks[step][0][row, 2, 0] = math.nan
    return chunks


def rnn(cfg=None):
    cfg = cfg or {}
    torch.manual_seed(6)
    model = SeqNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hidden = None

    def step_fn(model, batch, step):
        nonlocal hidden
        x, y = batch
        if hidden is None:
            hidden = torch.zeros(1, x.shape[0], 12)
        hidden = hidden.detach()                       # truncated BPTT: carry the state, not the graph
        opt.zero_grad(set_to_none=True)
        out, hidden = model(x, hidden)
        loss = F.mse_loss(out, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        return loss

    step_fn.hidden = lambda: hidden   # for the tests: the state the step carries
    return {"model": model, "step_fn": step_fn, "batches": _sequence_batches(12, cfg.get("nan_at")),
            "optimizer": opt}


_GLOBAL_STATE: dict = {}


def rnn_global_state(cfg=None):
    """The same RNN, but the hidden state lives in a module-level dict nanprobe cannot see."""
    cfg = cfg or {}
    torch.manual_seed(6)
    model = SeqNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _GLOBAL_STATE.clear()

    def step_fn(model, batch, step):
        x, y = batch
        h = _GLOBAL_STATE.get("h")
        if h is None:
            h = torch.zeros(1, x.shape[0], 12)
        opt.zero_grad(set_to_none=True)
        out, h = model(x, h.detach())
        _GLOBAL_STATE["h"] = h
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        return loss

    return {"model": model, "step_fn": step_fn, "batches": _sequence_batches(12, cfg.get("nan_at")),
            "optimizer": opt}


# -- a loss that raises on a NaN ----------------------------------------------------------------------

def bce_raises(cfg=None):
    """BCELoss on sigmoid outputs raises once a NaN reaches it (the input must be within [0, 1])."""
    cfg = cfg or {}
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    ds = Points(n=24, nan_at=cfg.get("nan_at"), seed=8)
    loader = DataLoader(ds, batch_size=4, shuffle=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m, b):
        return F.binary_cross_entropy(m(b["x"]).squeeze(1), (b["y"] > 0).float())

    return {"model": model, "loss_fn": loss_fn, "batches": loader, "optimizer": opt}


def bce_raises_nan():
    return bce_raises({"nan_at": 13})


def shuffled_bad_label():
    """A label out of range makes cross_entropy raise before any NaN exists."""
    return shuffled({"labels_bad_at": 29, "workers": 0})


# -- nanoGPT-like: the user's own step sets the LR by hand and accumulates micro-batches --------------

def hand_lr(cfg=None):
    cfg = cfg or {}
    torch.manual_seed(9)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.1)
    ds = Points(n=48, nan_at=cfg.get("nan_at"), seed=9)
    loader = DataLoader(ds, batch_size=4, shuffle=True)

    def get_lr(step):   # warmup, then cosine decay, as in nanoGPT
        return 3e-3 * min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * min(step, 20) / 20))

    def step_fn(model, micro_batches, step):
        for group in opt.param_groups:
            group["lr"] = get_lr(step)
        total = 0.0
        for micro in micro_batches:
            loss = ce_loss(model, micro) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    step_fn.get_lr = get_lr
    return {"model": model, "step_fn": step_fn, "batches": loader, "optimizer": opt, "accumulate": 2}


def accumulate_nan():
    return accumulate({"nan_at": 26})


def hand_lr_nan():
    return hand_lr({"nan_at": 30})


def gan_nan():
    return gan({"nan_at": 20})


def autocast_step(cfg=None):
    """A step_fn under torch.autocast(bf16), its context object created once and reused (as nanoGPT does)."""
    torch.manual_seed(10)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    loader = DataLoader(Points(n=24, seed=10), batch_size=4, shuffle=True)

    def step_fn(model, batch, step):
        opt.zero_grad(set_to_none=True)
        with ctx:
            loss = ce_loss(model, batch)
        loss.backward()
        opt.step()
        return loss

    step_fn.ctx = ctx
    return {"model": model, "step_fn": step_fn, "batches": loader, "optimizer": opt, "precision": "bf16"}


TARGETS = {"shuffled": shuffled, "frozen_bn": frozen_bn, "fp16_scaler": fp16_scaler, "accumulate": accumulate,
           "gan": gan, "rnn": rnn}
PLAIN = {"shuffled": plain_shuffled, "frozen_bn": plain_frozen_bn, "fp16_scaler": plain_fp16_scaler,
         "accumulate": plain_accumulate, "gan": plain_step_fn, "rnn": plain_step_fn}
