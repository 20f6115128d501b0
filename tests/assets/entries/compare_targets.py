"""Tiny targets for tests/compare/test_compare.py: an fp16 overflow in an attention matmul, an fp16 underflow
before a log, a GradScaler that has to back off, a healthy model, and a loss_fn that breaks in fp64."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attn(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-2, -1)  # no 1/sqrt(d) before the matmul
        return scores.softmax(-1) @ self.v(x)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = Attn(d)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class Net(nn.Module):
    def __init__(self, d: int = 16, n_blocks: int = 2, classes: int = 4):
        super().__init__()
        self.emb = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean(1)


def _batches(n=4, b=3, t=5, classes=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, t, 4, generator=g), torch.randint(0, classes, (b,), generator=g)) for _ in range(n)]


def _ce(m, b):
    return F.cross_entropy(m(b[0]), b[1])


def overflow():
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # blocks.1's q/k weights grew: scores reach ~2^17 in the matmul
        for lin in (model.blocks[1].attn.q, model.blocks[1].attn.k):
            lin.weight.normal_(0, 30.0)
    return {"model": model, "loss_fn": _ce, "batches": _batches(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3)}


def healthy():
    torch.manual_seed(0)
    model = Net()
    return {"model": model, "loss_fn": _ce, "batches": _batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "bf16"}


class Head(nn.Module):
    def __init__(self, d: int, classes: int):
        super().__init__()
        self.proj = nn.Linear(d, classes)

    def forward(self, x):
        probs = (30.0 * self.proj(x)).softmax(-1)  # sharp: most probabilities are ~1e-13
        return torch.log(probs)


class Clf(nn.Module):
    def __init__(self, d=16, classes=64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, d), nn.Tanh())
        self.head = Head(d, classes)

    def forward(self, x):
        return self.head(self.body(x))


def underflow():
    torch.manual_seed(0)
    model = Clf()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 64, (8,), generator=g)) for _ in range(3)]
    return {"model": model, "loss_fn": lambda m, b: F.nll_loss(m(b[0]), b[1]), "batches": batches,
            "optimizer": torch.optim.SGD(model.parameters(), lr=1e-2)}


def scaler():
    """fp16 with a GradScaler whose 2^16 scale makes the gradients overflow: it must back off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 8, generator=g) for _ in range(3)]
    return {"model": model, "loss_fn": lambda m, b: 40.0 * m(b).sum(), "batches": batches,
            "optimizer": torch.optim.SGD(model.parameters(), lr=1e-4), "precision": "fp16", "grad_scaler": True}


def fp64_breaks():
    """loss_fn builds a float32 tensor itself: fine in every precision but fp64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(3)]

    def loss_fn(m, b):
        mix = torch.eye(2, dtype=torch.float32)
        return F.cross_entropy(m(b[0]) @ mix, b[1])
    return {"model": model, "loss_fn": loss_fn, "batches": batches,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def no_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(3)]
    return {"model": model, "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]), "batches": batches}


def _on_cuda(t):
    t["model"].to("cuda")  # same Parameter objects: the optimizer stays tied
    t["batches"] = [tuple(x.to("cuda") for x in b) for b in t["batches"]]
    return t


def overflow_cuda():
    return _on_cuda(overflow())


def healthy_cuda():
    return _on_cuda(healthy())
