"""Under torch.distributed (2 processes, gloo, CPU) every rank skips the same step; capsules per rank."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port, leave_worker

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "entries"
BAD_ON_RANK1 = 3






def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    sys.path.insert(0, str(ASSETS))
    import guard_nan  # noqa: PLC0415 - the test asset, imported in the child

    from nanprobe.live.guard import Guard

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
    leave_worker()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_all_ranks_skip_the_same_step_and_write_their_own_capsule(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    expected = [i != BAD_ON_RANK1 for i in range(6)]
    assert r0["applied"] == r1["applied"] == expected
    assert r1["events"] == [[BAD_ON_RANK1, True, 1]]      # rank 1 saw it
    assert r0["events"] == [[BAD_ON_RANK1, False, 0]]     # rank 0 skipped because rank 1 did
    # the ranks' weights and optimizer state are still bitwise the same (only rank 1's batch differs): one
    # capsule directory, each rank its own file, the tensors written once
    (cap,) = tmp_path.glob(f"step{BAD_ON_RANK1:07d}-*.capsule")
    assert {"rank0.pt", "rank1.pt", ".metadata"} <= {p.name for p in cap.iterdir()}
    assert not list(tmp_path.glob("*.capsule.pt"))


def _own_weights_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    sys.path.insert(0, str(ASSETS))
    import guard_nan  # noqa: PLC0415 - the test asset, imported in the child

    from nanprobe.live.guard import Guard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(rank)   # each rank its own weights: nothing is replicated
        t = guard_nan.build(bad_step=BAD_ON_RANK1 if rank == 1 else -1)
        model, opt = t["model"], t["optimizer"]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * rank)
        guard = Guard(model, opt, capsule_dir=out_dir)
        for batch in t["batches"][:BAD_ON_RANK1 + 1]:
            with guard.step(batch):
                opt.zero_grad(set_to_none=True)
                guard.backward(t["loss_fn"](model, batch))
            guard.optimizer_step()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_worker()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ranks_with_their_own_weights_write_a_capsule_file_each(tmp_path):
    mp.spawn(_own_weights_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    names = sorted(p.name for p in tmp_path.glob("*.capsule.pt"))
    assert [n.split("-")[:2] for n in names] == [[f"step{BAD_ON_RANK1:07d}", "rank0"],
                                                 [f"step{BAD_ON_RANK1:07d}", "rank1"]]
    assert not list(tmp_path.glob("*.capsule"))


# -- FSDP2 (fully_shard): DTensor gradients; the same weights as without nanprobe ---------------------------

FSDP2 = Path(__file__).resolve().parents[1] / "assets" / "watch" / "fsdp2_trainer.py"


@contextlib.contextmanager
def _log_lines(name: str):
    """The messages logger ``name`` writes meanwhile."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, log = Keep(), logging.getLogger(name)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
BAD_FSDP = 2


def _fsdp2_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os
    import runpy

    from nanprobe.watch import watch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      CAPSULES=str(Path(out_dir, "guard")), CLIP="1.0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        seen = {}
        for name, bad, guarded, watched in [("plain", -1, False, False), ("guard", -1, True, False),
                                             ("watch", -1, False, True), ("guard_bad", BAD_FSDP, True, False),
                                             ("watch_bad", BAD_FSDP, False, True)]:
            os.environ.update(BAD_STEP=str(bad), GUARD="1" if guarded else "0", OUT=str(Path(out_dir, name + ".pt")))
            if watched:
                result = watch(["python", str(FSDP2)], dirpath=Path(out_dir, name))
                seen[name] = [[e.step, e.local, e.reason, e.action] for e in result.events]
            else:
                with _log_lines("nanprobe.guard") as lines:
                    runpy.run_path(str(FSDP2), run_name="__main__")
                seen[name + "_lines"] = [ln.split("Replay it: nanprobe run ENTRY ")[-1] for ln in lines
                                         if "Replay it" in ln]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_worker()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_guard_and_watch_keep_healthy_weights_and_name_the_rank_that_broke(tmp_path):
    mp.spawn(_fsdp2_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    plain = torch.load(tmp_path / "plain.pt")
    for name in ("guard", "watch"):   # healthy: bitwise the weights of the plain loop
        got = torch.load(tmp_path / f"{name}.pt")
        assert plain.keys() == got.keys() and all(torch.equal(plain[k], got[k]) for k in plain), name
    for name in ("guard_bad", "watch_bad"):
        assert all(torch.isfinite(v).all() for v in torch.load(tmp_path / f"{name}.pt").values())
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r1["watch_bad"] == [[BAD_FSDP, True, "loss is nan", "skipped"]]   # rank 1's own loss
    # rank 0's gradients are NaN too (the reduction carried them): it names rank 1 as the origin
    assert r0["watch_bad"] == [[BAD_FSDP, False, "gradient norm is nan: rank 1's loss was non-finite and its "
                                                  "gradients reached every rank", "skipped"]]
    assert r0["watch"] == r1["watch"] == []
    # one capsule for the step: a directory both ranks wrote with torch.distributed.checkpoint (each its
    # own shards, no full model gathered on any rank) and each its own rank file
    assert not list((tmp_path / "guard").glob("*.capsule.pt"))
    (cap,) = (tmp_path / "guard").glob(f"step{BAD_FSDP:07d}-*.capsule")
    assert {p.name for p in cap.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", "rank0.pt", "rank1.pt"}
    # the state it holds, resharded on one process, is bitwise the full state the run had before the step
    from nanprobe.capsule import sharded

    before, state = torch.load(tmp_path / "guard_bad.pt.before"), sharded.load_state(cap)
    assert before["model"].keys() == state["model"].keys()
    assert all(torch.equal(before["model"][k], state["model"][k]) for k in before["model"])
    assert before["optimizer"].keys() == state["optimizers"]["0"].keys()
    assert all(torch.equal(v, state["optimizers"]["0"][n][k]) for n, st in before["optimizer"].items()
               for k, v in st.items())
    # every rank's log line is the command that replays it, and watch wrote one too
    assert r0["guard_bad_lines"] == r1["guard_bad_lines"] == [f"--capsule {cap}"]
    (wcap,) = (tmp_path / "watch_bad").glob(f"step{BAD_FSDP:07d}-*.capsule")
    # it replays on one process, resharded into the unsharded model: same step, cause and phase, and the
    # rank whose batch broke it
    from nanprobe.pipeline.diagnose import diagnose

    for path in (cap, wcap):
        report = diagnose(f"{FSDP2.parent / 'fsdp2_entry.py'}:target", capsule=str(path))
        if path == cap:   # (watch's capsule holds the root module's inputs; its loss lives outside the model)
            assert (report.step, report.top.cause.value, report.top.phase.value) == (BAD_FSDP, "data", "input")
        assert report.step == BAD_FSDP and any(f.cause.value == "data" for f in report.findings)
        assert report.extra["rank"]["rank"] == 1 and report.extra["rank"]["world_size"] == 2
        assert report.to_json()["rank"]["rank"] == 1
        if path == cap:
            assert report.extra["rank"]["replayed"] == [{"rank": 0, "nonfinite": False},
                                                        {"rank": 1, "nonfinite": True}]
            assert report.notes[0].startswith("rank 1 of 2 produced the first non-finite value")
        else:   # the model's output is not the loss: no rank's rerun sees it; the rank the run named is used
            assert report.extra["rank"]["run_named"] == 1 and not report.extra["rank"]["reproduced"]
