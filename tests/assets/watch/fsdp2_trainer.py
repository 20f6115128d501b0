"""An FSDP2 training script (``fully_shard``, gloo, CPU; RANK/WORLD_SIZE/MASTER_* set as torchrun does).

At step ``BAD_STEP`` rank 1's batch holds a NaN: that rank's loss is NaN, and the gradient reduction
carries the NaN to every rank's gradient shard. ``GUARD=1``: the loop uses ``nanprobe.Guard``
(``CLIP``: its max_grad_norm). The full weights go to ``OUT`` (rank 0), and the full model and
optimizer state before the bad step to ``OUT.before``. A process group that is
already up is used as it is (the test runs the script several times in one process).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    bad_step = int(os.environ.get("BAD_STEP", "-1"))
    clip = float(os.environ.get("CLIP", "0")) or None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = None
    if os.environ.get("GUARD") == "1":
        import nanprobe

        guard = nanprobe.Guard(model, opt, capsule_dir=os.environ["CAPSULES"])
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if step == bad_step:   # the full state before the bad step (every rank gathers; rank 0 saves it)
            names = {id(p): n for n, p in model.named_parameters()}
            before = {"model": {k: v.full_tensor() for k, v in model.state_dict().items()},
                      "optimizer": {names[id(p)]: {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                                                   for k, v in st.items()} for p, st in opt.state.items()}}
            if rank == 0:
                torch.save(before, os.environ["OUT"] + ".before")
            if rank == 1:
                x[0, 0] = float("nan")
        if guard is not None:
            with guard.step((x, y)):
                opt.zero_grad()
                guard.backward(((model(x) - y) ** 2).mean())
            guard.optimizer_step(max_grad_norm=clip)
        else:
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.environ["OUT"])
    dist.barrier()
    if owned:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
