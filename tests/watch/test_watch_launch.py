"""`nanprobe watch -- torchrun ... / accelerate launch ... / bash ...`: the command runs as a subprocess and the
Python processes it starts are followed (a bootstrap every child interpreter inherits), each rank writing its
own report, one summary line at the end."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from conftest import free_port
from nanprobe.surface.cli import app
from nanprobe.live import HookEvent
from nanprobe.watch import WatchResult, watch
from nanprobe.watch.launch import ProcessRow, follows

WATCH = Path(__file__).resolve().parents[1] / "assets" / "watch"
DDP = WATCH / "ddp_trainer.py"
OWN = WATCH / "own_trainer.py"
BIN = Path(sys.executable).parent
BAD_STEP, BAD_RANK = 2, 1
runner = CliRunner()

needs_dist = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")




def _env(tmp_path: Path, name: str, **extra: str) -> dict[str, str]:
    """The environment of a launched run: one thread per rank, ddp_trainer's weights per rank."""
    return dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path / f"{name}{{rank}}.pt"), **extra)


def _setenv(monkeypatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), *args]


def _weights(tmp_path: Path, name: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(tmp_path / f"{name}{rank}.pt") for rank in (0, 1)]


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_follows_launchers_and_keeps_python_scripts_in_process():
    assert follows(["torchrun", "--nproc-per-node", "2", "train.py"])
    assert follows(["accelerate", "launch", "train.py"]) and follows(["bash", "run.sh"])
    assert follows(["python", "-m", "torch.distributed.run", "train.py"])
    assert follows([sys.executable, "-m", "accelerate.commands.launch", "train.py"])
    assert not follows(["python", "train.py"]) and not follows(["python3", "-m", "pkg.train"])
    assert not follows([sys.executable, str(OWN)]) and not follows([])


def _event(step: int, rank: int, local: bool, report: str | None = None) -> HookEvent:
    return HookEvent(step=step, status="nonfinite", reason="loss is nan", action="skipped", local=local,
                     headline="h", capsule=None, report=report, command=None, rank=rank)


def test_the_summary_line_counts_processes_steps_bad_steps_and_reports():
    """One bad step skipped by every rank of a job is one bad step; separate processes' are their own; the
    report named is the rank's that saw it; failed and killed processes are named."""
    rows = (ProcessRow(pid=10, rank=0, world_size=4, steps=3, events=(_event(2, 0, False),), exit=None),
            ProcessRow(pid=11, rank=2, world_size=4, steps=5, events=(_event(2, 2, True, "r2.json"),), exit=1,
                       error="ValueError: x"))
    result = WatchResult(argv=("torchrun",), exit_code=1, steps=8, events=rows[0].events + rows[1].events,
                         processes=rows)
    assert result.summary() == ("nanprobe watch: 2 processes (ranks 0, 2), 8 optimizer steps seen, 1 bad step, "
                                "1 report written (first: r2.json); rank 0 was killed before it exited; rank 2 "
                                "exited 1 (ValueError: x)")
    alone = (ProcessRow(pid=1, rank=None, world_size=None, steps=4, events=(_event(1, 0, True, "a.json"),)),
             ProcessRow(pid=2, rank=None, world_size=None, steps=4, events=(_event(1, 0, True, "b.json"),)))
    result = WatchResult(argv=("bash",), exit_code=0, steps=8, events=alone[0].events + alone[1].events,
                         processes=alone)
    assert result.summary() == "nanprobe watch: 2 processes, 4 optimizer steps seen in each, 2 bad steps, " \
                               "2 reports written (first: a.json)"
    assert WatchResult(argv=("ls",), exit_code=0, steps=0, processes=()).summary().startswith(
        "nanprobe watch: warning: the command started no Python process nanprobe could follow")


@needs_dist
def test_watch_cli_follows_torchrun_ranks_and_reports_the_rank_that_saw_the_bad_step(tmp_path):
    """The CLI (a process of its own) over `python -m torch.distributed.run`: rank 1's loss is NaN at step 2,
    rank 0 skips the step with it; one report (rank 1's), one capsule directory, one summary line."""
    reports = tmp_path / "reports"
    env = _env(tmp_path, "w", BAD_STEP=str(BAD_STEP), BAD_RANK=str(BAD_RANK))
    res = subprocess.run([str(BIN / "nanprobe"), "watch", "--dir", str(reports), "--json", str(tmp_path / "r.json"),
                          "--", *_torchrun(str(DDP))], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert re.fullmatch(r"nanprobe watch: 2 processes \(ranks 0-1\), 5 optimizer steps seen in each, 1 bad step, "
                        r"1 report written \(first: .*step0000002-rank1-\d+T\d+-\d+\.json\)", lines[-1]), lines[-1]
    assert any(line.startswith("nanprobe watch: rank 1: step 2: non-finite values born in forward") for line in lines)
    assert any(line.startswith("nanprobe watch: step 2: another rank saw a non-finite value") for line in lines)
    # the loss is outside the model, but --at does not re-execute a distributed job: the capsule replays it
    assert all(line.endswith(".capsule") and "Replay: nanprobe run ENTRY --capsule " in line
               for line in lines if "step 2:" in line)
    # the replicas' capsule: one directory (weights written once, torch.distributed.checkpoint) with each
    # rank's own file; the report is the rank that saw it
    [capsule] = reports.glob("step0000002-*.capsule")
    assert sorted(p.name for p in capsule.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    [path] = reports.glob("*.json")
    report = json.loads(path.read_text())
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert (report["command"], report["step"], report["status"]) == ("watch", BAD_STEP, "nonfinite")
    assert (report["watch"]["rank"], report["watch"]["world_size"], report["watch"]["local"]) == (BAD_RANK, 2, True)
    assert report["watch"]["reason"] == "loss is nan" and report["watch"]["action"] == "skipped"
    assert report["origin"]["phase"] == "forward" and report["findings"][0]["cause"] == "log"
    w0, w1 = _weights(tmp_path, "w")
    assert _bitwise(w0, w1) and all(torch.isfinite(v).all() for v in w0.values())   # in sync, finite


@needs_dist
def test_watch_under_torchrun_keeps_a_healthy_runs_weights_bitwise(tmp_path, monkeypatch):
    # the oracle: the plain job's weights (saved before its teardown: a gloo abort at a rank's interpreter exit,
    # torch's own and rare under load, fails the job's exit code but not what this compares)
    plain = subprocess.run([str(BIN / "torchrun"), *_torchrun(str(DDP))[3:]], env=_env(tmp_path, "plain"),
                           capture_output=True, text=True, timeout=120)
    assert all((tmp_path / f"plain{rank}.pt").exists() for rank in (0, 1)), plain.stderr[-3000:]
    _setenv(monkeypatch, _env(tmp_path, "watched"))
    result = watch([str(BIN / "torchrun"), *_torchrun(str(DDP))[3:]], dirpath=tmp_path / "reports")
    assert result.exit_code == 0 and result.events == () and result.steps == 10
    rows = result.processes
    assert [(r.rank, r.world_size, r.steps, r.exit, r.root) for r in rows] == \
        [(0, 2, 5, 0, "DistributedDataParallel"), (1, 2, 5, 0, "DistributedDataParallel")]
    assert result.summary() == "nanprobe watch: 2 processes (ranks 0-1), 5 optimizer steps seen in each, " \
                               "0 bad steps, 0 reports written"
    assert not (tmp_path / "reports").exists()
    for plain, watched in zip(_weights(tmp_path, "plain"), _weights(tmp_path, "watched")):
        assert _bitwise(plain, watched)


@needs_dist
def test_watch_follows_accelerate_launch_processes(tmp_path, monkeypatch):
    """A script written for accelerate (Accelerator(cpu=True), prepare, accelerator.backward) under
    `accelerate launch`: 2 CPU processes through accelerate's multi-process launcher (torch.distributed.run)
    with --multi_gpu; --cpu would run one process (several need mpirun). Rank 1's batch holds a NaN."""
    if os.environ.get("NANPROBE_INTEGRATION_TESTS") != "required":   # CI installs it: missing fails there
        pytest.importorskip("accelerate")
    _setenv(monkeypatch, _env(tmp_path, "w", BAD_STEP=str(BAD_STEP), BAD_RANK=str(BAD_RANK)))
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           str(WATCH / "accelerate_trainer.py")]
    result = watch(cmd, dirpath=tmp_path / "reports", json_out=tmp_path / "r.json")
    assert result.exit_code == 0
    assert [(r.rank, r.world_size, r.steps) for r in result.processes] == [(0, 2, 4), (1, 2, 4)]
    e0, e1 = (r.events for r in result.processes)
    assert [(e.step, e.rank, e.local, e.action, bool(e.report)) for e in e0 + e1] == \
        [(BAD_STEP, 0, False, "skipped", False), (BAD_STEP, BAD_RANK, True, "skipped", True)]
    assert result.json == str(tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["step"], report["watch"]["rank"], report["watch"]["world_size"]) == (BAD_STEP, BAD_RANK, 2)
    top = report["findings"][0]
    assert (top["cause"], top["phase"]) == ("data", "input")
    assert result.summary().startswith("nanprobe watch: 2 processes (ranks 0-1), 4 optimizer steps seen in each, "
                                       "1 bad step, 1 report written (first: ")
    w0, w1 = _weights(tmp_path, "w")
    assert _bitwise(w0, w1) and all(torch.isfinite(v).all() for v in w0.values())   # skipped on both ranks


def _first_nan_of_plain_run() -> int:
    """own_trainer.py run as `python own_trainer.py --epochs 2` would (here, no nanprobe): its first NaN step."""
    out = io.StringIO()
    argv, path0 = list(sys.argv), sys.path[0]
    sys.argv, sys.path[0] = [str(OWN), "--epochs", "2"], str(WATCH)
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            runpy.run_path(str(OWN), run_name="__main__")
    finally:
        sys.argv, sys.path[0] = argv, path0
    return min(int(m.group(1)) for m in re.finditer(r"step (\d+) loss nan", out.getvalue()))


def test_watch_follows_the_python_script_a_shell_command_starts_and_returns_its_exit_code(tmp_path, monkeypatch):
    expected = _first_nan_of_plain_run()
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    result = watch(["bash", "-c", f"python {OWN} --epochs 2 --exit-code 3 > {tmp_path / 'out.txt'}"],
                   dirpath=tmp_path / "reports")
    assert result.exit_code == 3
    [row] = result.processes
    assert (row.rank, row.world_size, row.steps, row.exit, row.root) == (None, None, 16, 3, "PoissonNet")
    first = row.events[0]
    assert (first.step, first.reason, first.action) == (expected, "loss is nan", "skipped") and first.report
    report = json.loads(Path(first.report).read_text())
    assert (report["origin"]["op"], report["findings"][0]["cause"]) == ("aten.log.default", "log")
    assert (tmp_path / "out.txt").read_text().splitlines()[-1] == "done"
    assert result.summary().startswith(f"nanprobe watch: 1 process, 16 optimizer steps seen, {len(row.events)} bad "
                                       "steps, 1 report written (first: ")
    assert result.summary().endswith("; pid %d exited 3" % row.pid)


DATALOADER = """
import json, os, sys, torch, torch.nn as nn
from torch.optim import optimizer as optim_module
from torch.utils.data import DataLoader, Dataset

class Probe(Dataset):   # what a DataLoader worker finds installed: nothing of nanprobe's
    def __len__(self):
        return 32
    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        if info is not None and i % 8 == 0:
            hooks = torch.nn.modules.module
            state = {"pid": os.getpid(), "module_hooks": len(hooks._global_forward_pre_hooks)
                     + len(hooks._global_forward_hooks), "optimizer_hooks":
                     len(optim_module._global_optimizer_pre_hooks), "backward":
                     torch.autograd.backward.__module__}
            open(os.path.join(sys.argv[1], f"worker-{os.getpid()}.json"), "w").write(json.dumps(state))
        return torch.full((4,), i / 32.0), torch.tensor(1.0)

if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(Probe(), batch_size=8, num_workers=2):
        loss = ((model(x).squeeze(-1) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    raise ValueError("after training")
"""


def test_dataloader_workers_stay_inert_and_a_raising_script_is_counted(tmp_path, monkeypatch):
    """Workers forked from a watched process carry no hook and write no row; the script's own exception
    is its exit code (1) and named in the summary."""
    script = tmp_path / "loader.py"
    script.write_text(DATALOADER)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = watch(["bash", "-c", f"{sys.executable} {script} {tmp_path}"], dirpath=tmp_path / "reports")
    assert result.exit_code == 1
    [row] = result.processes
    assert (row.steps, row.exit, row.error) == (4, 1, "ValueError: after training")
    workers = [json.loads(p.read_text()) for p in tmp_path.glob("worker-*.json")]
    assert len({w["pid"] for w in workers}) == 2 and row.pid not in {w["pid"] for w in workers}
    assert all((w["module_hooks"], w["optimizer_hooks"], w["backward"]) == (0, 0, "torch.autograd") for w in workers)
    assert result.summary().endswith(f"; pid {row.pid} exited 1 (ValueError: after training)")


@needs_dist
def test_watch_counts_a_rank_that_crashed_and_one_the_launcher_stopped(tmp_path, monkeypatch):
    """Rank 1 raises after its bad step; torchrun then stops rank 0 (SIGTERM skips atexit, or it fails in the
    next collective): both are counted, rank 1's bad step and exception are named, the exit code is torchrun's."""
    _setenv(monkeypatch, _env(tmp_path, "w", BAD_STEP=str(BAD_STEP), BAD_RANK=str(BAD_RANK), CRASH_STEP="3"))
    result = watch(_torchrun(str(DDP)), dirpath=tmp_path / "reports")
    assert result.exit_code == 1
    r0, r1 = result.processes
    assert (r0.rank, r1.rank, r1.exit, r1.error) == (0, 1, 1, "ValueError: rank 1 crashed after step 3")
    assert r0.exit in (1, None) and r0.steps >= BAD_STEP + 1 and r1.steps == 4
    assert [(e.step, e.rank, e.local, bool(e.report)) for e in r0.events + r1.events] == \
        [(BAD_STEP, 0, False, False), (BAD_STEP, BAD_RANK, True, True)]
    line = result.summary()
    assert line.startswith("nanprobe watch: 2 processes (ranks 0-1), ") and ", 1 bad step, 1 report written" in line
    assert line.endswith("; rank 1 exited 1 (ValueError: rank 1 crashed after step 3)")


SPAWNER = """
import os, sys
import torch.multiprocessing as mp

def rank_main(rank, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, {folder!r})
    import ddp_trainer
    ddp_trainer.main()

if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]),), nprocs=2, join=True)
"""


@needs_dist
def test_watch_follows_ranks_a_script_spawns_itself(tmp_path, monkeypatch):
    """`torch.multiprocessing.spawn` children are fresh interpreters: they inherit the bootstrap too. The
    spawning script took no step: it is not counted next to its ranks."""
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER.format(folder=str(WATCH)))
    _setenv(monkeypatch, _env(tmp_path, "w", BAD_STEP=str(BAD_STEP), BAD_RANK=str(BAD_RANK)))
    result = watch(["bash", "-c", f"{sys.executable} {script} {free_port()}"], dirpath=tmp_path / "reports")
    assert result.exit_code == 0
    assert [(r.rank, r.steps) for r in result.processes] == [(None, 0), (0, 5), (1, 5)]
    assert [(e.step, e.rank, e.local, bool(e.report)) for e in result.events] == \
        [(BAD_STEP, 0, False, False), (BAD_STEP, BAD_RANK, True, True)]
    assert result.summary().startswith("nanprobe watch: 2 processes (ranks 0-1), 5 optimizer steps seen in each, "
                                       "1 bad step, 1 report written (first: ")


BY_HAND = ("import torch\nw = torch.ones(3, requires_grad=True)\nfor _ in range(3):\n"
           "    (w * w).sum().backward()\n    with torch.no_grad():\n        w -= 0.1 * w.grad\n    w.grad = None\n")


def test_watch_warns_when_no_python_process_or_no_optimizer_step_was_seen(tmp_path, monkeypatch):
    """Never silence: a command that starts no Python training process, and one whose script updates by hand.
    The bootstrap runs the sitecustomize it shadows (the user's, on PYTHONPATH)."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text(f"open({str(tmp_path / 'ran.txt')!r}, 'a').write('ran\\n')\n")
    monkeypatch.setenv("PYTHONPATH", str(user))
    res = runner.invoke(app, ["watch", "--dir", str(tmp_path / "r"), "--", "bash", "-c",
                              f"{sys.executable} -c 'import json'; exit 5"])
    assert res.exit_code == 5
    assert (tmp_path / "ran.txt").read_text() == "ran\n"
    assert res.stderr.splitlines()[-1].startswith("nanprobe watch: warning: the command started no Python process "
                                                  "nanprobe could follow")
    script = tmp_path / "by_hand.py"
    script.write_text(BY_HAND)
    res = runner.invoke(app, ["watch", "--dir", str(tmp_path / "r"), "--", "bash", "-c", f"{sys.executable} {script}"])
    assert res.exit_code == 0
    assert res.stderr.splitlines()[-1].startswith("nanprobe watch: warning: 1 process followed, but no optimizer "
                                                  "step was seen, so nothing was checked")
    assert not (tmp_path / "r").exists()


@needs_dist
def test_watch_over_ranks_that_run_their_own_watch_says_so_and_does_not_watch_twice(tmp_path, monkeypatch):
    """`torchrun ... --no-python nanprobe watch -- python train.py` under an outer watch: each rank's own
    (in-process) watch guards and reports it; the outer one adds no second Watcher and says so."""
    _setenv(monkeypatch, _env(tmp_path, "w", BAD_STEP=str(BAD_STEP), BAD_RANK=str(BAD_RANK)))
    inner = tmp_path / "inner"
    result = watch([str(BIN / "torchrun"), *_torchrun()[3:], "--no-python", str(BIN / "nanprobe"), "watch", "--dir",
                    str(inner), "--", sys.executable, str(DDP)], dirpath=tmp_path / "outer")
    assert result.exit_code == 0 and not (tmp_path / "outer").exists()
    assert [(r.rank, r.own_watch, r.steps) for r in result.processes] == [(0, True, 0), (1, True, 0)]
    assert result.summary() == "nanprobe watch: 2 processes (ranks 0-1) ran their own nanprobe watch (its lines " \
                               "above say what it saw)"
    assert [p.name.split("-")[1] for p in inner.glob("*.json")] == ["rank1"]
    [capsule] = inner.glob("*.capsule")                 # one capsule directory: not written twice
    assert sorted(p.name for p in capsule.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]


def test_watch_of_a_missing_command_exits_2_with_one_line():
    res = runner.invoke(app, ["watch", "--", "no-such-command-for-nanprobe", "train.py"])
    assert res.exit_code == 2
    assert res.stderr.startswith("nanprobe: error: command 'no-such-command-for-nanprobe' not found")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.output
