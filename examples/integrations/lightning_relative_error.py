"""A LightningModule whose loss goes to inf in its second epoch; the only nanprobe line is the callback.

    pip install -e ".[lightning]" && python examples/integrations/lightning_relative_error.py

From epoch 1 the loss adds a relative error |pred - y| / |y|; one sample has target 0, and the first
optimizer step whose batch holds it divides by zero. NanprobeCallback skips that update, diagnoses
the step in-process and writes the report to nanprobe-reports/; training goes on.
"""

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nanprobe.integrations.lightning import NanprobeCallback


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x).squeeze(-1)
        loss = F.mse_loss(pred, y)
        if self.current_epoch >= 1:
            loss = loss + ((pred - y) / y).abs().mean()   # relative error: y == 0 divides by zero
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)}


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x.sum(-1) + 3.0
    y[5] = 0.0
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        callbacks=[NanprobeCallback()])   # <- the one line nanprobe needs
    trainer.fit(Regressor(), loader)


if __name__ == "__main__":
    main()
