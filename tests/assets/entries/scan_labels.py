"""Label problems: (x, y) tuple batches and a token-level LM batch layout."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def _pairs(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def out_of_range():
    """3 classes; step 4 sample 6 has label 5 (>= 3), step 1 sample 2 has label -1."""
    torch.manual_seed(0)
    batches = _pairs()
    batches[4][1][6] = 5
    batches[1][1][2] = -1
    return {"model": nn.Linear(4, 3), "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]), "batches": batches}


class Hidden(nn.Module):
    """Returns hidden states (width 4); loss_fn applies the 50-way head itself."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 50)

    def forward(self, x):
        return self.body(x)


def hidden_states():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 50, (8,), generator=g)) for _ in range(4)]
    return {"model": Hidden(), "loss_fn": lambda m, b: F.cross_entropy(m.head(m(b[0])), b[1]), "batches": batches}


class TinyLM(nn.Module):
    def __init__(self, vocab=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, vocab)

    def forward(self, ids):
        return self.head(self.drop(self.emb(ids)))


def _lm_batches(n=5):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 16, (4, 6), generator=g)
        labels = ids.clone()
        labels[:, -2:] = -100           # padding positions are ignored
        out.append({"input_ids": ids, "labels": labels})
    return out


def all_ignored():
    """Step 2: every label is -100, so a mean cross-entropy is 0/0."""
    torch.manual_seed(0)
    batches = _lm_batches()
    batches[2]["labels"][:] = -100
    model = TinyLM()
    return {"model": model, "batches": batches,
            "loss_fn": lambda m, b: F.cross_entropy(m(b["input_ids"]).flatten(0, 1), b["labels"].flatten())}


def lm_clean():
    torch.manual_seed(0)
    model = TinyLM()
    return {"model": model, "batches": _lm_batches(),
            "loss_fn": lambda m, b: F.cross_entropy(m(b["input_ids"]).flatten(0, 1), b["labels"].flatten())}
