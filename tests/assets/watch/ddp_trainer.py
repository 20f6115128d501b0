"""A DDP training script (gloo, CPU; launched with RANK/WORLD_SIZE/MASTER_* set, as torchrun does).

A Poisson rate regression without a softplus. At step ``BAD_STEP`` rank 1's batch holds an outlier
that drives one predicted rate below 0: that rank's loss is NaN (log of a negative rate) while every
gradient stays finite (d/dr of r - y log r is 1 - y/r), so only that rank can see the bad step.
Under a launcher (one environment for all ranks) ``BAD_RANK`` names the rank that gets it, and ``OUT``
may hold ``{rank}``; ``CRASH_STEP``: that rank raises ValueError after that step.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bad_step = int(os.environ.get("BAD_STEP", "-1"))
    if os.environ.get("BAD_RANK", str(rank)) != str(rank):
        bad_step = -1
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    nn.init.constant_(net.bias, 2.0)
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        x, counts = 0.1 * torch.randn(8, 4, generator=g), torch.ones(8)
        if step == bad_step:
            x[3] = -10.0 * net.weight.detach().sign().squeeze(0)   # the outlier: rate < 0
        rate = model(x).squeeze(-1)
        loss = (rate - counts * torch.log(rate)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == int(os.environ.get("CRASH_STEP", "-1")) and str(rank) == os.environ.get("BAD_RANK"):
            raise ValueError(f"rank {rank} crashed after step {step}")
    torch.save(net.state_dict(), os.environ["OUT"].format(rank=rank))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
