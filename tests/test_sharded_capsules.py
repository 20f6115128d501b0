"""FSDP1 and DDP ``no_sync`` under the Guard and ``nanprobe watch`` (2 processes, gloo, CPU): a healthy run
ends with bitwise the weights of the plain loop, a broken one skips the right step on every rank and
names the rank that broke; its capsule is a torch.distributed.checkpoint directory that ``nanprobe run``
replays on one process to the same step, cause and rank. And a capsule directory never runs code."""

from __future__ import annotations

import json
import os
import pickle
import runpy
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WATCH = Path(__file__).resolve().parent / "assets" / "watch"
BAD = 2
RUNS = [("plain", -1, False, False), ("guard", -1, True, False), ("watch", -1, False, True),
        ("guard_bad", BAD, True, False), ("watch_bad", BAD, False, True)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, script: str, env: dict[str, str]) -> None:
    from nanprobe.watch import watch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        seen = {}
        for name, bad, guarded, watched in RUNS:
            os.environ.update(BAD_STEP=str(bad), GUARD="1" if guarded else "0", OUT=str(Path(out_dir, name + ".pt")),
                              CAPSULES=str(Path(out_dir, name)))
            if watched:
                result = watch(["python", script], dirpath=Path(out_dir, name))
                seen[name] = [[e.step, e.local, e.reason, e.action] for e in result.events]
            else:
                runpy.run_path(script, run_name="__main__")
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, script: str, env: dict[str, str]) -> tuple[dict, dict]:
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), str(WATCH / script), env), nprocs=2, join=True)
    plain = torch.load(tmp_path / "plain.pt")
    for name in ("guard", "watch"):   # healthy: bitwise the weights of the plain loop
        got = torch.load(tmp_path / f"{name}.pt")
        assert plain.keys() == got.keys() and all(torch.equal(plain[k], got[k]) for k in plain), name
    for name in ("guard_bad", "watch_bad"):
        assert all(torch.isfinite(v).all() for v in torch.load(tmp_path / f"{name}.pt").values()), name
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["watch"] == r1["watch"] == []
    return r0, r1


def _replays_to_rank1(tmp_path: Path, entry: str) -> None:
    """The Guard's capsule of the bad step is one directory (DCP files, a file per rank); replayed on one
    process it names the step, the data and rank 1, whose batch alone is non-finite."""
    from nanprobe.diagnose import diagnose

    (cap,) = (tmp_path / "guard_bad").glob(f"step{BAD:07d}-*.capsule")
    names = {p.name for p in cap.iterdir()}
    assert {".metadata", "rank0.pt", "rank1.pt"} <= names and any(n.endswith(".distcp") for n in names)
    report = diagnose(f"{WATCH / entry}:target", capsule=str(cap))
    assert (report.step, report.top.cause.value, report.top.phase.value) == (BAD, "data", "input")
    assert report.extra["rank"]["rank"] == 1
    assert report.extra["rank"]["replayed"] == [{"rank": 0, "nonfinite": False}, {"rank": 1, "nonfinite": True}]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("use_orig", [False, True])
def test_fsdp1_guard_and_watch_keep_healthy_weights_and_name_the_rank_that_broke(tmp_path, use_orig):
    # flat parameters with clipping (the Guard calls FSDP1's clip_grad_norm_); original parameters without
    # (the Guard's own norm: each rank's shard norm, summed over FSDP's process group)
    r0, r1 = _run(tmp_path, "fsdp1_trainer.py", {"USE_ORIG": "1" if use_orig else "0", "CLIP": "0" if use_orig else "1.0"})
    fsdp = [json.loads((tmp_path / f"plain.pt.rank{r}.json").read_text()) for r in (0, 1)]
    ours = [json.loads((tmp_path / f"guard.pt.rank{r}.json").read_text()) for r in (0, 1)]
    assert fsdp[0] == fsdp[1] and len(fsdp[0]) == 4   # the global norm, the same on every rank
    assert ours[0] == ours[1] and ours[0] == pytest.approx(fsdp[0], rel=1e-6)
    assert r1["watch_bad"] == [[BAD, True, "loss is nan", "skipped"]]
    assert r0["watch_bad"] == [[BAD, False, "gradient norm is nan: rank 1's loss was non-finite and its gradients "
                                            "reached every rank", "skipped"]]
    _replays_to_rank1(tmp_path, "fsdp2_entry.py")


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_no_sync_accumulation_under_guard_and_watch(tmp_path):
    r0, r1 = _run(tmp_path, "ddp_accum.py", {})
    assert r1["watch_bad"] == [[BAD, True, "loss is nan", "skipped"]]
    assert r0["watch_bad"] == [[BAD, False, "gradient norm is nan: rank 1's loss was non-finite and its gradients "
                                            "reached every rank", "skipped"]]
    _replays_to_rank1(tmp_path, "ddp_accum_entry.py")
