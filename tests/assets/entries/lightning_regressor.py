"""The ENTRY a Lightning user writes to replay a NanprobeCallback capsule: the same LightningModule and
optimizer, and a loss_fn that calls its training_step (no Trainer)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations"))

from test_integrations import Regressor  # noqa: E402


def loss_fn(model, batch):
    return model.training_step(batch, 0)


def target():
    torch.manual_seed(0)
    module = Regressor()
    opt = module.configure_optimizers()
    return {"model": module, "loss_fn": loss_fn, "batches": [], "optimizer": opt["optimizer"],
            "scheduler": opt["lr_scheduler"]}
