"""A training script written for HF accelerate (``accelerate launch ... accelerate_trainer.py``), on CPU.

``Accelerator(cpu=True)`` prepares the model (DDP over gloo when launched with several processes), the
optimizer (``AcceleratedOptimizer``) and the data loader (each rank its shard). At step ``BAD_STEP`` the
batch of rank ``BAD_RANK`` holds a NaN feature: that rank's loss is NaN (cause ``data``). ``OUT`` (may hold
``{rank}``) receives the weights.
"""

import os

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    acc = Accelerator(cpu=True)
    bad_step = int(os.environ.get("BAD_STEP", "-1"))
    bad_rank = int(os.environ.get("BAD_RANK", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    model, opt, data = acc.prepare(model, opt, data)
    for step, (x, y) in enumerate(data):
        if step == bad_step and acc.process_index == bad_rank:
            x = x.clone()
            x[3, 1] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
    torch.save(acc.unwrap_model(model).state_dict(), os.environ["OUT"].format(rank=acc.process_index))
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
