"""An FSDP1 training script (``FullyShardedDataParallel``, gloo, CPU; RANK/WORLD_SIZE/MASTER_* set as
torchrun does). ``USE_ORIG=1``: ``use_orig_params=True`` (each original parameter a view of the flat
shard; a rank may hold no element of one), else flat parameters.

At step ``BAD_STEP`` rank 1's batch holds a NaN: that rank's loss is NaN, and the gradient reduce-scatter
carries the NaN to every rank's shard. ``CLIP``: FSDP1's own ``model.clip_grad_norm_`` (the norm of the
whole sharded gradient) in the plain loop, the Guard's ``max_grad_norm`` under ``GUARD=1``. The full
weights go to ``OUT`` (rank 0), each rank's gradient norms (the Guard's, or FSDP1's own) to
``OUT.rankR.json``. A process group that is already up is used as it is.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main() -> None:
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    bad_step = int(os.environ.get("BAD_STEP", "-1"))
    clip = float(os.environ.get("CLIP", "0")) or None
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                 use_orig_params=os.environ.get("USE_ORIG") == "1", device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = None
    if os.environ.get("GUARD") == "1":
        import nanprobe

        guard = nanprobe.Guard(model, opt, capsule_dir=os.environ["CAPSULES"])
    g = torch.Generator().manual_seed(rank)
    norms = []
    for step in range(4):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if step == bad_step and rank == 1:
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
            # FSDP1's own norm of the whole sharded gradient (max_norm inf: the gradients are left as they are)
            norms.append(float(model.clip_grad_norm_(clip or float("inf"))))
            opt.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if guard is not None:
        norms = [h["grad_norm"] for h in guard.state_dict()["history"]]
    with open(f"{os.environ['OUT']}.rank{rank}.json", "w") as fh:
        json.dump(norms, fh)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, os.environ["OUT"])
    dist.barrier()
    if owned:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
