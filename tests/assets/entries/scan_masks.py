"""Attention masks that mask out a whole row: attention over nothing is 0/0 = NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, ids, keep):
        h = self.emb(ids) * keep.unsqueeze(-1)
        return self.head(h.sum(1) / keep.sum(1, keepdim=True))


def _batches(n=4):
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 20, (6, 5), generator=g)
        mask = torch.ones(6, 5, dtype=torch.long)
        mask[:, 4] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (6,), generator=g)})
    return out


def _loss(m, b):
    keep = b["attention_mask"] if "attention_mask" in b else (~b["key_padding_mask"]).long()
    return F.cross_entropy(m(b["input_ids"], keep.float()), b["labels"])


def attention_mask():
    """Step 1, sample 3: attention_mask is all zero."""
    torch.manual_seed(0)
    batches = _batches()
    batches[1]["attention_mask"][3] = 0
    return {"model": Pool(), "loss_fn": _loss, "batches": batches}


def key_padding_mask():
    """PyTorch convention (True = padding). Step 2, sample 1 is all padding."""
    torch.manual_seed(0)
    batches = _batches()
    for b in batches:
        b["key_padding_mask"] = b.pop("attention_mask") == 0
    batches[2]["key_padding_mask"][1] = True
    return {"model": Pool(), "loss_fn": _loss, "batches": batches}
