"""`nanprobe watch -- torchrun ... train.py` (or ``accelerate launch``, ``python -m torch.distributed.run``,
``bash run.sh``): the command runs as a subprocess and every Python process it starts is followed.

The command gets a folder prepended to ``PYTHONPATH`` whose ``sitecustomize.py`` is
:mod:`nanprobe.watch._bootstrap` (``NANPROBE_WATCH_RUN``: the run directory, ``NANPROBE_WATCH``: the
settings as JSON); each child's Watcher (:mod:`nanprobe.watch.child`) writes one row per process there,
which the parent reads back (:func:`read_rows`) into the ``processes`` of its ``WatchResult``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..base.config import Config
from ..base.errors import UsageError
from ..live import HookEvent
from ._bootstrap import RUN_ENV, RUN_PREFIX, SETTINGS_ENV

followed = 0   # commands run by run_command in this process (an outer watch's bootstrap reads it)

# `python -m MODULE` that starts other Python processes: followed, not run in-process
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
                    "accelerate.commands.accelerate_cli", "deepspeed.launcher.runner")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessRow:
    """One followed Python process: what its Watcher saw, and how it ended."""

    pid: int
    rank: int | None               # RANK (or torch.distributed's rank); None outside a distributed job
    world_size: int | None
    steps: int                     # optimizer steps of its guarded optimizer
    events: tuple[HookEvent, ...] = ()
    exit: int | None = 0           # sys.exit's code, 1 after an uncaught exception (as Python exits); a bare
                                   # `raise SystemExit(n)` is not seen (0); None: it never reached its exit
                                   # (killed: the row is from its last bad step)
    error: str | None = None       # the uncaught exception's one line (or why nanprobe did not start)
    root: str | None = None
    argv: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    own_watch: bool = False        # it ran `nanprobe watch -- python ...` itself, which reported it


def is_python(exe: str) -> bool:
    """``python``, ``python3.11``, or this interpreter by another name."""
    return os.path.basename(exe).startswith("python") or \
        os.path.realpath(shutil.which(exe) or exe) == os.path.realpath(sys.executable)


def follows(command: Sequence[str]) -> bool:
    """The command is run as a subprocess whose Python children are followed: anything but ``python
    SCRIPT`` / ``python -m MODULE`` (those run in-process), and ``python -m`` of a known launcher."""
    argv = list(command)
    return bool(argv) and (not is_python(argv[0]) or len(argv) > 2 and argv[1] == "-m" and argv[2] in LAUNCHER_MODULES)


# -- in the parent: run the command, read the rows --------------------------------------------------------

def read_rows(folder: str | os.PathLike) -> tuple[ProcessRow, ...]:
    """The rows the followed processes wrote, by rank (then pid)."""
    rows = []
    for path in Path(folder).glob("process-*.json"):
        try:
            data = json.loads(path.read_text())
            rows.append(ProcessRow(pid=int(data["pid"]), rank=data.get("rank"), world_size=data.get("world_size"),
                                   steps=int(data.get("steps", 0)), exit=data.get("exit"), error=data.get("error"),
                                   events=tuple(HookEvent(**e) for e in data.get("events", [])),
                                   root=data.get("root"), argv=tuple(data.get("argv", ())),
                                   notes=tuple(data.get("notes", ())), own_watch=bool(data.get("own_watch"))))
        except (OSError, ValueError, KeyError, TypeError):   # not a row this nanprobe wrote
            continue
    return tuple(sorted(rows, key=lambda r: (r.rank if r.rank is not None else -1, r.pid)))


def _wait(proc: subprocess.Popen) -> int:
    """Wait for the command; Ctrl-C reaches it through the terminal (its process group), SIGTERM is
    passed on. A command killed by signal N exits 128 + N, as a shell says."""
    previous = None
    with contextlib.suppress(ValueError):   # not the main thread
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        while True:
            with contextlib.suppress(KeyboardInterrupt):
                code = proc.wait()
                break
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 128 - code if code < 0 else code


def run_command(command: Sequence[str], *, cfg: Config, policy: str, dirpath: str | os.PathLike, entry: str | None,
                max_reports: int) -> tuple[int, tuple[ProcessRow, ...]]:
    """Run the command with the bootstrap in its environment, the watch settings every child reads
    (``NANPROBE_WATCH``) as plain JSON; its exit code and the processes' rows."""
    settings = {"policy": policy, "dirpath": str(Path(dirpath).resolve()), "entry": entry, "max_reports": max_reports,
                "config": dataclasses.asdict(cfg), "path": str(Path(__file__).resolve().parents[2])}
    global followed
    followed += 1
    run = Path(tempfile.mkdtemp(prefix=RUN_PREFIX))
    try:
        boot = run / "bootstrap"
        boot.mkdir()
        shutil.copyfile(Path(__file__).with_name("_bootstrap.py"), boot / "sitecustomize.py")
        env = dict(os.environ, **{RUN_ENV: str(run), SETTINGS_ENV: json.dumps(settings)})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(boot), env.get("PYTHONPATH")]))
        try:
            proc = subprocess.Popen(list(command), env=env)
        except FileNotFoundError:
            raise UsageError(f"command {command[0]!r} not found", "nanprobe watch",
                             "Check the command after --: e.g. nanprobe watch -- torchrun --nproc-per-node 2 "
                             "train.py") from None
        except PermissionError:
            raise UsageError(f"command {command[0]!r} is not executable", "nanprobe watch",
                             "Check the command after --") from None
        return _wait(proc), read_rows(run)
    finally:
        shutil.rmtree(run, ignore_errors=True)


__all__ = ["ProcessRow", "LAUNCHER_MODULES", "follows", "is_python", "run_command", "read_rows"]
