"""Clean, realistic-looking data: token ids, a padding attention mask, -100 labels on padding,
float features of different scales per column, a constant-by-design key. Nothing to report."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class LM(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.feat = nn.Linear(3, 8)
        self.head = nn.Linear(8, vocab)

    def forward(self, ids, features):
        return self.head(self.emb(ids) + self.feat(features))


def _loss(m, b):
    logits = m(b["input_ids"], b["features"])
    return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())


def target():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(8)
    batches = []
    for _ in range(30):
        ids = torch.randint(1, 50, (8, 12), generator=g)
        lengths = torch.randint(3, 13, (8,), generator=g)
        mask = (torch.arange(12) < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        features = torch.randn(8, 12, 3, generator=g) * torch.tensor([1.0, 100.0, 0.01])
        batches.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels,
                        "features": features, "scale": torch.ones(8)})
    return {"model": LM(), "loss_fn": _loss, "batches": batches}
