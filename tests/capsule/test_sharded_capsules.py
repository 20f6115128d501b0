"""FSDP1 and DDP ``no_sync`` under the Guard and ``nanprobe watch`` (2 processes, gloo, CPU): a healthy run
ends with bitwise the weights of the plain loop, a broken one skips the right step on every rank and
names the rank that broke; its capsule is a torch.distributed.checkpoint directory that ``nanprobe run``
replays on one process to the same step, cause and rank. And a capsule directory never runs code."""

from __future__ import annotations

import json
import os
import pickle
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port, leave_worker

WATCH = Path(__file__).resolve().parents[1] / "assets" / "watch"
BAD = 2
RUNS = [("plain", -1, False, False), ("guard", -1, True, False), ("watch", -1, False, True),
        ("guard_bad", BAD, True, False), ("watch_bad", BAD, False, True)]






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
    leave_worker()


def _run(tmp_path: Path, script: str, env: dict[str, str]) -> tuple[dict, dict]:
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), str(WATCH / script), env), nprocs=2, join=True)
    plain = torch.load(tmp_path / "plain.pt")
    for name in ("guard", "watch"):   # healthy: bitwise the weights of the plain loop
        got = torch.load(tmp_path / f"{name}.pt")
        assert plain.keys() == got.keys() and all(torch.equal(plain[k], got[k]) for k in plain), name
    for name in ("guard_bad", "watch_bad"):
        assert all(torch.isfinite(v).all() for v in torch.load(tmp_path / f"{name}.pt").values()), name
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["watch"] == r1["watch"] == []
    return r0, r1


def _replays_to_rank1(tmp_path: Path, entry: str, runs: tuple[str, ...] = ("guard_bad", "watch_bad")) -> None:
    """The Guard's capsule of the bad step is one directory (DCP files, a file per rank); replayed on one
    process it names the step, the data and rank 1, whose batch alone is non-finite."""
    from nanprobe.pipeline.diagnose import diagnose

    for run in runs:   # one directory each, no capsule files
        (cap,) = (tmp_path / run).glob(f"step{BAD:07d}-*.capsule")
        names = {p.name for p in cap.iterdir()}
        assert {".metadata", "rank0.pt", "rank1.pt"} <= names and any(n.endswith(".distcp") for n in names)
        assert not list((tmp_path / run).glob("*.capsule.pt"))
    (cap,) = (tmp_path / "guard_bad").glob(f"step{BAD:07d}-*.capsule")
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
    # (watch sees the module inside DistributedDataParallel: its replicas are found equal, one directory too)
    _replays_to_rank1(tmp_path, "ddp_accum_entry.py")


# -- a capsule directory on one process (made here without a process group: DCP saves on one process too) ----


def _capsule_dir(tmp_path: Path, bad_rank: int = 1, status: str = "nonfinite") -> Path:
    """A sharded capsule of step 2 of a 2-rank run as the guard writes it: DCP files with the model and
    AdamW state, and each rank's file (rank ``bad_rank``'s batch holds a NaN)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    import torch.nn as nn

    from nanprobe.capsule import build, sharded
    from nanprobe.reach.state import capture_rng

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ((model(torch.randn(8, 4)) - 1) ** 2).mean().backward()
    opt.step()
    cap = tmp_path / "step0000002-20260101T000000-1.capsule"
    cap.mkdir()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "reference.pt")
    names = {id(p): n for n, p in model.named_parameters()}
    tensors, meta = sharded._split_optimizer(opt, names, [], 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "no process group: assuming one process"
        dcp.save({"model": model.state_dict(), "optimizers": {"0": tensors}}, checkpoint_id=cap)
    g = torch.Generator().manual_seed(1)
    for r in range(2):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if r == bad_rank:
            x[0, 0] = float("nan")
        data = build(model=model, optimizers=[opt], schedulers=[], scalers=[], micro_batches=[(x, y)],
                     rng=capture_rng("cpu"), micro_rng=None, step=2, precision="fp32", status=status,
                     reason="loss is nan" if r == bad_rank else "another rank saw a non-finite value",
                     record={"step": 2, "loss": float("nan") if r == bad_rank else 1.0, "finite": False},
                     history=[], rank=r, world_size=2, local=r == bad_rank, max_grad_norm=1.0)
        data.update(model={}, optimizers=[meta], sharded={"kind": "dcp"})
        torch.save(data, cap / f"rank{r}.pt")
    return cap


def test_a_capsule_directory_replays_on_one_process_and_the_cli_names_the_rank(tmp_path):
    from typer.testing import CliRunner

    from nanprobe.capsule import read, sharded
    from nanprobe.surface.cli import app

    cap = _capsule_dir(tmp_path)
    state = sharded.load_state(cap)
    assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(state["optimizers"]["0"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["run", f"{WATCH / 'fsdp2_entry.py'}:target", "--capsule", str(cap),
                                      "--json", str(out)])
    assert result.exit_code == 1, result.output
    report = json.loads(out.read_text())
    assert report["step"] == 2 and report["findings"][0]["cause"] == "data"
    assert report["rank"]["rank"] == 1 and report["rank"]["replayed"][1] == {"rank": 1, "nonfinite": True}
    result = CliRunner().invoke(app, ["run", f"{WATCH / 'fsdp2_entry.py'}:target", "--capsule", str(cap)])
    assert result.exit_code == 1 and "rank 1 of 2 produced the first non-finite value" in " ".join(result.output.split())
    # `run --at 2` finds the directory in guard.capsule_dir
    import dataclasses

    from nanprobe.base.config import load_config
    from nanprobe.pipeline.diagnose import diagnose

    cfg = load_config()
    cfg = dataclasses.replace(cfg, guard=dataclasses.replace(cfg.guard, capsule_dir=str(tmp_path)))
    report = diagnose(f"{WATCH / 'fsdp2_entry.py'}:target", at=2, config=cfg)
    assert (report.step, report.top.cause.value, report.extra["rank"]["rank"]) == (2, "data", 1)


def test_a_capsule_directory_never_runs_code_and_says_what_is_missing(tmp_path):
    from nanprobe.capsule import read, sharded
    from nanprobe.base.errors import CapsuleError

    cap = _capsule_dir(tmp_path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (cap / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CapsuleError, match="names (posix|os).system, which a capsule never holds"):
        sharded.load_state(cap)
    assert not marker.exists()
    (tmp_path / "b").mkdir()
    cap = _capsule_dir(tmp_path / "b")
    (cap / "rank1.pt").unlink()
    with pytest.raises(CapsuleError, match=r"lacks the file of rank\(s\) 1 of 2"):
        sharded.read_dir(cap, read)


def test_a_capsule_directory_too_big_for_this_machine_says_so(tmp_path, monkeypatch):
    from nanprobe.capsule import read, sharded
    from nanprobe.base.errors import CapsuleError

    cap = _capsule_dir(tmp_path)
    full = sharded.state_bytes(cap)
    assert full == sum(4 * n for n in (32, 8, 8, 1)) * 3 + 4 * 4   # weights, two AdamW moments, 4 step counts
    monkeypatch.setattr(sharded, "available_bytes", lambda: full)   # it needs twice that
    with pytest.raises(CapsuleError, match="need .* GiB of memory on one process"):
        sharded.read_dir(cap, read)


def test_one_rank_file_alone_says_to_pass_the_directory(tmp_path):
    from nanprobe.pipeline.diagnose import diagnose
    from nanprobe.base.errors import CapsuleError

    cap = _capsule_dir(tmp_path)
    with pytest.raises(CapsuleError, match="rank 1's file of a sharded capsule") as err:
        diagnose(f"{WATCH / 'fsdp2_entry.py'}:target", capsule=str(cap / "rank1.pt"))
    assert f"--capsule {cap}" in str(err.value)


def test_a_resumed_guard_keeps_its_capsule_directories(tmp_path):
    import torch.nn as nn

    from nanprobe.live.guard import Guard

    cap = _capsule_dir(tmp_path)
    model = nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), capsule_dir=tmp_path)
    state = guard.state_dict()
    state["capsules"] = [str(cap), str(tmp_path / "elsewhere.capsule")]
    guard.load_state_dict(state)
    assert guard.capsules == [cap.resolve()]


def test_a_spike_capsule_directory_is_the_rank_that_saw_it(tmp_path):
    from nanprobe.capsule import capsule_reach
    from nanprobe.base.config import load_config
    from nanprobe.reach.entry import load_target

    cap = _capsule_dir(tmp_path, bad_rank=0, status="spike")
    loaded = load_target(f"{WATCH / 'fsdp2_entry.py'}:target")
    extra: dict = {}
    reached, _ = capsule_reach(loaded, load_config(), capsule=str(cap), at=None, extra=extra)
    assert extra["rank"]["rank"] == 0 and extra["rank"]["replayed"] == [] and not extra["rank"]["reproduced"]
    assert reached.notes[0].startswith("the step is a spike (finite values); diagnosing rank 0's step")
    # the entrypoint's model and optimizer hold bitwise the state the capsule was written from
    ref = torch.load(tmp_path / "reference.pt")
    model, opt = loaded.target.model, loaded.target.optimizers[0][1]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in ref["model"].items())
    live = opt.state_dict()
    assert live["param_groups"] == ref["optimizer"]["param_groups"]
    assert live["state"].keys() == ref["optimizer"]["state"].keys()
    assert all(torch.equal(v, live["state"][i][k]) for i, st in ref["optimizer"]["state"].items() for k, v in st.items())
