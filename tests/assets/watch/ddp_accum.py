"""A DDP training script with gradient accumulation (gloo, CPU; RANK/WORLD_SIZE/MASTER_* set as torchrun
does): each step runs two micro-batches, the first under ``model.no_sync()`` (its gradients stay on
the rank), the second synchronised (the all-reduce of the summed gradients).

At step ``BAD_STEP`` rank 1's FIRST micro-batch holds a NaN: its gradients are NaN on rank 1 only
until the second micro-batch's all-reduce carries them to every rank. ``GUARD=1``: the loop uses
``nanprobe.Guard`` (one ``guard.step`` per micro-batch). The weights go to ``OUT`` (rank 0). A process
group that is already up is used as it is.
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    bad_step = int(os.environ.get("BAD_STEP", "-1"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = None
    if os.environ.get("GUARD") == "1":
        import nanprobe

        guard = nanprobe.Guard(model, opt, capsule_dir=os.environ["CAPSULES"])
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        opt.zero_grad()
        for micro in range(2):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            if step == bad_step and rank == 1 and micro == 0:
                x[0, 0] = float("nan")
            sync = contextlib.nullcontext() if micro == 1 else model.no_sync()
            if guard is not None:
                with guard.step((x, y)), sync:
                    guard.backward(((model(x) - y) ** 2).mean() / 2)
            else:
                with sync:
                    (((model(x) - y) ** 2).mean() / 2).backward()
        if guard is not None:
            guard.optimizer_step()
        else:
            opt.step()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, os.environ["OUT"])
    dist.barrier()
    if owned:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
