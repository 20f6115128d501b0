"""AdamW(fused=True) with eps=0: the NaN is born inside one fused kernel that updates every parameter.

The same bug as ``adam_eps_zero.py`` (``eps=0`` and embedding rows whose
gradient is exactly 0: Adam's update is 0 / (sqrt(0) + 0) = NaN for them), in
the optimizer GPUs default to: ``fused=True`` (or ``foreach=True``). A fused
step is one op, ``aten._fused_adamw_``, over the lists of all parameters,
gradients and moments; a foreach step is a few ops over those lists. The model
registers its classifier before its embedding, so the parameter that goes NaN
is not the first of the lists: nanprobe names the one whose tensor in the
lists went non-finite (``embed.weight``) and reads its own second moment.

Expected diagnosis: cause ``div``, phase ``update``, module ``embed``
(parameter ``embed.weight``, ``exp_avg_sq`` exactly 0 where eps = 0), step 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, USED_IDS, N_CLASSES, BATCH_SIZE, SEQ_LEN, N_STEPS = 100, 50, 4, 16, 12, 10


class Classifier(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 16, n_classes: int = N_CLASSES):
        super().__init__()
        self.head = nn.Linear(dim, n_classes)    # registered first: the first tensor of every list
        self.embed = nn.Embedding(vocab, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_STEPS):
        tokens = torch.randint(0, USED_IDS, (BATCH_SIZE, SEQ_LEN), generator=g)
        batches.append({"tokens": tokens, "label": tokens[:, 0] % N_CLASSES})
    return batches


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["tokens"]), batch["label"])


def target(config: dict | None = None):
    """``config["optimizer"]``: ``<name>-fused`` or ``<name>-foreach`` (default adamw-fused), name one of
    adamw, adam, adagrad (fused on CPU: these three), rmsprop, nadam, radam, adamax, adadelta - the same
    eps=0 bug in the optimizers PyTorch ships with a fused/foreach step."""
    torch.manual_seed(0)
    model = Classifier()
    name, flag = (config or {}).get("optimizer", "adamw-fused").split("-")
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad,
           "rmsprop": torch.optim.RMSprop, "nadam": torch.optim.NAdam, "radam": torch.optim.RAdam,
           "adamax": torch.optim.Adamax, "adadelta": torch.optim.Adadelta}[name]
    opt = cls(model.parameters(), lr=1e-2, eps=0.0, **{flag: True})
    return {"model": model, "loss_fn": classification_loss, "batches": make_batches(), "optimizer": opt}


if __name__ == "__main__":
    from plain_loop import train

    train(target())
