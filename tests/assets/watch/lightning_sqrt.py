"""A Lightning script (closure optimizer steps) whose NaN is born in backward: a distance computed in
``training_step`` with ``sqrt``, exactly 0 in the first batch (of epoch 1) that holds the sample whose
prediction is pinned to its target; sqrt's gradient at 0 is 0/0.

    python lightning_sqrt.py

Prints ``step K grads nan`` after the backward that made the gradients non-finite (Lightning's own step).
"""

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y, pinned = batch
        pred = self.net(x).squeeze(-1)
        target = torch.where(pinned, pred.detach(), y) if self.current_epoch >= 1 else y
        return torch.sqrt((pred - target) ** 2).mean()   # |pred - target|: 0 for a pinned sample

    def on_after_backward(self):
        if not all(bool(torch.isfinite(p.grad).all()) for p in self.parameters() if p.grad is not None):
            print(f"step {self.global_step} grads nan")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x.sum(-1)
    pinned = torch.zeros(32, dtype=torch.bool)
    pinned[5] = True
    loader = DataLoader(TensorDataset(x, y, pinned), batch_size=4, shuffle=True)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), loader)


if __name__ == "__main__":
    main()
