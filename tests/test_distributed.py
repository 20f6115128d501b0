"""Under torch.distributed (2 processes, gloo, CPU) every rank skips the same step; capsules per rank."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ASSETS = Path(__file__).resolve().parent / "assets" / "entries"
BAD_ON_RANK1 = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    sys.path.insert(0, str(ASSETS))
    import guard_nan  # noqa: PLC0415 - the test asset, imported in the child

    from nanprobe.guard import Guard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        # only rank 1's data has the bad sample; rank 0's data is clean
        t = guard_nan.build(bad_step=BAD_ON_RANK1 if rank == 1 else -1)
        model, opt = t["model"], t["optimizer"]
        guard = Guard(model, opt, entry=str(ASSETS / "guard_nan.py") + ":target", capsule_dir=out_dir)
        applied = []
        for batch in t["batches"][:6]:
            with guard.step(batch):
                opt.zero_grad(set_to_none=True)
                guard.backward(t["loss_fn"](model, batch))
            applied.append(bool(guard.optimizer_step()))
        events = [(e.step, e.local, e.rank) for e in guard.events]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"applied": applied, "events": events}))
        dist.barrier()  # both ranks done before gloo tears down (else a rank can abort at exit)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_all_ranks_skip_the_same_step_and_write_their_own_capsule(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    expected = [i != BAD_ON_RANK1 for i in range(6)]
    assert r0["applied"] == r1["applied"] == expected
    assert r1["events"] == [[BAD_ON_RANK1, True, 1]]      # rank 1 saw it
    assert r0["events"] == [[BAD_ON_RANK1, False, 0]]     # rank 0 skipped because rank 1 did
    names = sorted(p.name for p in tmp_path.glob("*.capsule.pt"))
    assert len(names) == 2
    assert any("-rank0-" in n for n in names) and any("-rank1-" in n for n in names)
