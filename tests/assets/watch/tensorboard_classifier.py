"""A healthy classifier that logs its loss to its own TensorBoard SummaryWriter (the log dir: argv[1]).

Under `nanprobe watch` the precursor series (the head's log Z and logit mean, every monitored step) go to the
same writer as ``nanprobe/...`` scalars, beside the script's ``loss``.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter


def main(logdir: str, steps: int = 25) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    writer = SummaryWriter(log_dir=logdir)
    x, y = torch.randn(64, 8), torch.randint(0, 5, (64,))
    for step in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        writer.add_scalar("loss", loss.item(), step)
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1])
