"""`nanprobe watch -- torchrun ... train.py` (or ``accelerate launch``, ``python -m torch.distributed.run``,
``bash run.sh``): the command runs as a subprocess and every Python process it starts is followed.

The command gets a folder prepended to ``PYTHONPATH`` whose ``sitecustomize.py`` is
:mod:`nanprobe.watch._bootstrap`, and two environment variables: ``NANPROBE_WATCH_RUN`` (a run directory)
and ``NANPROBE_WATCH`` (the watch settings as JSON). In each child interpreter the first optimizer
built starts a :class:`~nanprobe.watch.watcher.Watcher` (:func:`start_watcher`: the in-process path's
code), and at exit :func:`finish_watcher` finishes it; the bootstrap writes one row per process into the
run directory. The parent waits for the command, reads the rows (:func:`read_rows`) and returns the
command's exit code in a :class:`~nanprobe.watch.run.WatchResult` whose ``processes`` are the rows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import UsageError
from ..hooked import HookEvent, Stopped, resolve_config
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

    @property
    def reports(self) -> tuple[str, ...]:
        return tuple(e.report for e in self.events if e.report)


def follows(command: Sequence[str]) -> bool:
    """The command is run as a subprocess whose Python children are followed: anything but ``python
    SCRIPT`` / ``python -m MODULE`` (those run in-process), and ``python -m`` of a known launcher."""
    from .run import is_python

    argv = list(command)
    if not argv:
        return False
    if not is_python(argv[0]):
        return True
    return len(argv) > 2 and argv[1] == "-m" and argv[2] in LAUNCHER_MODULES


# -- in the child: the Watcher ----------------------------------------------------------------------------

def settings_for(*, cfg: Config, policy: str, dirpath: str | os.PathLike, entry: str | None,
                 max_reports: int) -> dict[str, Any]:
    """The watch settings every child reads (``NANPROBE_WATCH``): plain JSON."""
    return {"policy": policy, "dirpath": str(Path(dirpath).resolve()), "entry": entry, "max_reports": max_reports,
            "config": dataclasses.asdict(cfg), "path": str(Path(__file__).resolve().parents[2])}


class _Notify(logging.Handler):
    """Calls back after each line the Watcher logs (a bad step): the bootstrap rewrites the process's row,
    so a rank the launcher kills (SIGTERM: no ``atexit``) still shows its bad steps."""

    def __init__(self, callback: Callable[[], None]):
        super().__init__()
        self._callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._callback()
        except Exception:  # noqa: BLE001 - never into the user's training
            pass


def start_watcher(settings: dict[str, Any], on_event: Callable[[], None] | None = None):
    """In a child process, when it builds its first optimizer: a Watcher with the parent's settings,
    installed; its log lines go to stderr as under the CLI, then ``on_event`` is called."""
    from .watcher import Watcher

    log = logging.getLogger("nanprobe.watch")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
    if on_event is not None:
        log.addHandler(_Notify(on_event))
    cfg = resolve_config(settings.get("config"), "nanprobe watch")
    watcher = Watcher(config=cfg, policy=settings.get("policy", "skip"),
                      dirpath=settings.get("dirpath", "nanprobe-reports"), entry=settings.get("entry"),
                      max_reports=int(settings.get("max_reports", 1)))
    watcher.__enter__()
    return watcher


def finish_watcher(watcher) -> dict[str, Any]:
    """At the child's exit: the pending bad step diagnosed, the hooks removed; the row's fields."""
    error = None
    try:
        watcher.finish_at_exit()
    except Stopped as exc:
        error = exc.message
    except Exception as exc:  # noqa: BLE001 - the process is exiting: the row says what went wrong
        error = f"nanprobe: internal error at exit: {type(exc).__name__}: {exc}"
    finally:
        watcher.__exit__()
    return dict(watcher_row(watcher), error=error)


def watcher_row(watcher) -> dict[str, Any]:
    """What the Watcher saw so far, as the row's fields (the bootstrap adds pid, argv, exit, RANK...)."""
    # (rank, world) as the guard last read it (the process group is often gone by exit); RANK and
    # WORLD_SIZE, where the launcher set them, come first (the bootstrap)
    rank, world = getattr(watcher.guard, "_world", None) or (None, None)
    if world is not None and world <= 1:
        rank = world = None
    return {"steps": watcher.steps, "events": [dataclasses.asdict(e) for e in watcher.events],
            "root": type(watcher.root).__name__ if watcher.root is not None else None,
            "notes": list(watcher.notes), "error": None, "rank": rank, "world_size": world}


# -- in the parent: run the command, read the rows --------------------------------------------------------

def read_rows(folder: str | os.PathLike) -> tuple[ProcessRow, ...]:
    """The rows the followed processes wrote, by rank (then pid)."""
    rows = []
    for path in Path(folder).glob("process-*.json"):
        try:
            data = json.loads(path.read_text())
            events = tuple(HookEvent(**e) for e in data.get("events", []))
            row = ProcessRow(pid=int(data["pid"]), rank=data.get("rank"), world_size=data.get("world_size"),
                             steps=int(data.get("steps", 0)), events=events, exit=data.get("exit"),
                             error=data.get("error"), root=data.get("root"), argv=tuple(data.get("argv", ())),
                             notes=tuple(data.get("notes", ())), own_watch=bool(data.get("own_watch")))
        except (OSError, ValueError, KeyError, TypeError):   # not a row this nanprobe wrote
            continue
        rows.append(row)
    return tuple(sorted(rows, key=lambda r: (r.rank if r.rank is not None else -1, r.pid)))


def _wait(proc: subprocess.Popen) -> int:
    """Wait for the command; Ctrl-C reaches it through the terminal (its process group), SIGTERM is
    passed on. A command killed by signal N exits 128 + N, as a shell says."""
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    except ValueError:   # not the main thread
        pass
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 128 - code if code < 0 else code


def run_command(command: Sequence[str], settings: dict[str, Any]) -> tuple[int, tuple[ProcessRow, ...]]:
    """Run the command with the bootstrap in its environment; its exit code and the processes' rows."""
    global followed
    followed += 1
    run = Path(tempfile.mkdtemp(prefix=RUN_PREFIX))
    try:
        boot = run / "bootstrap"
        boot.mkdir()
        shutil.copyfile(Path(__file__).with_name("_bootstrap.py"), boot / "sitecustomize.py")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(boot), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        env[RUN_ENV] = str(run)
        env[SETTINGS_ENV] = json.dumps(settings)
        try:
            proc = subprocess.Popen(list(command), env=env)
        except FileNotFoundError:
            raise UsageError(f"command {command[0]!r} not found", "nanprobe watch",
                             "Check the command after --: e.g. nanprobe watch -- torchrun --nproc-per-node 2 "
                             "train.py") from None
        except PermissionError:
            raise UsageError(f"command {command[0]!r} is not executable", "nanprobe watch",
                             "Check the command after --") from None
        code = _wait(proc)
        return code, read_rows(run)
    finally:
        shutil.rmtree(run, ignore_errors=True)


__all__ = ["ProcessRow", "LAUNCHER_MODULES", "follows", "run_command", "read_rows", "settings_for",
           "start_watcher", "finish_watcher", "watcher_row"]
