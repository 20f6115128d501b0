"""Running the watched script: the command after `--`, the script's environment, its exit code."""

from __future__ import annotations

import contextlib
import os
import runpy
import shutil
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..hooked import HookEvent, Stopped, check_policy, resolve_config, shown
from .watcher import POLICIES, Watcher

_PYTHONS = ("python", "python3")


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchResult:
    """What ``nanprobe watch`` saw: the script's own exit code, the guarded steps, the bad ones."""

    argv: tuple[str, ...]
    exit_code: int                 # the script's (1 when it raised, as Python exits)
    steps: int                     # optimizer steps of the guarded optimizer
    events: tuple[HookEvent, ...] = ()
    root: str | None = None        # the root module's class
    json: str | None = None        # where --json wrote the first bad step's report
    error: str | None = None       # the script raised: the exception's one line
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        """The one line at the end: what was watched, or a warning that nothing was."""
        if self.steps == 0:
            return ("nanprobe watch: warning: no optimizer step was seen, so nothing was checked. watch guards "
                    "the steps of torch.optim optimizers (optimizer.step(), GradScaler.step); an update written "
                    "by hand (p -= lr * p.grad) or a script that exits before training is not seen: use "
                    "nanprobe.Guard in such a loop")
        bad = len(self.events)
        reports = sum(1 for e in self.events if e.report)
        return (f"nanprobe watch: 1 process, {self.steps} optimizer step(s) seen, {bad} bad step(s), "
                f"{reports} report(s) written" + (f" (first: {shown(self.events[0].report)})" if reports else ""))


# -- the command line after `--` ----------------------------------------------------------------------

def parse_command(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """``python train.py ARGS`` / ``python -m pkg.train ARGS`` -> (kind, target, args)."""
    argv = list(argv)
    if not argv:
        raise UsageError("no command to watch", "nanprobe watch", "Give it after --: nanprobe watch -- python "
                                                                   "train.py ARGS")
    exe = argv[0]
    name = os.path.basename(exe)
    known = name.startswith(_PYTHONS) or os.path.realpath(shutil.which(exe) or exe) == os.path.realpath(sys.executable)
    if not known:
        raise UsageError(f"{exe!r} is not a Python interpreter", "nanprobe watch",
                         "Watch a Python script: nanprobe watch -- python train.py ARGS (or python -m pkg.train); "
                         "under torchrun: torchrun ... --no-python nanprobe watch -- python train.py")
    rest = argv[1:]
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            raise UsageError("python -m needs a module", "nanprobe watch",
                             "Write: nanprobe watch -- python -m pkg.train")
        return "module", rest[1], rest[2:]
    if not rest or rest[0].startswith("-"):
        raise UsageError(f"cannot watch {' '.join(argv)!r}", "nanprobe watch",
                         "Give a script: nanprobe watch -- python train.py ARGS (or python -m pkg.train ARGS)")
    if not Path(rest[0]).is_file():
        raise UsageError(f"script {rest[0]!r} not found", "nanprobe watch",
                         f"Check the path (relative to {os.getcwd()})")
    return "script", rest[0], rest[1:]


# -- running the script -----------------------------------------------------------------------------------

@contextlib.contextmanager
def _script_environment(kind: str, target: str, args: list[str]):
    argv, path0 = list(sys.argv), sys.path[0] if sys.path else None
    if kind == "script":
        sys.argv = [target, *args]
        folder = str(Path(target).resolve().parent)
        if sys.path:
            sys.path[0] = folder
        else:
            sys.path.insert(0, folder)
    else:
        sys.argv = [target, *args]
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.argv = argv
        if path0 is not None and sys.path:
            sys.path[0] = path0


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def watch(command: Sequence[str], *, json_out: str | os.PathLike | None = None, policy: str = "skip",
          config: Any = None, dirpath: str | os.PathLike = "nanprobe-reports", entry: str | None = None,
          check_every: int | None = None, max_reports: int = 1) -> WatchResult:
    """Run ``python train.py ARGS`` (or ``python -m pkg.train ARGS``) in this process under the guard.

    The script's output goes where it would; its exit code is the result's (an exception it raises is
    printed as Python would, exit code 1). Bad steps are logged on the ``nanprobe.watch`` logger.
    """
    check_policy(policy, POLICIES, "--policy")
    kind, target, args = parse_command(command)
    cfg = resolve_config(config, "nanprobe watch", check_every=check_every)
    if json_out is not None and str(json_out) == "-":
        raise UsageError("--json - would mix the report with the script's output", "--json",
                         "Give a file: --json report.json")
    if isinstance(max_reports, bool) or not isinstance(max_reports, int) or max_reports < 0:
        raise UsageError(f"--max-reports {max_reports!r}", "nanprobe watch",
                         "Give the number of bad steps to diagnose in-process (0: none, only capsules)")
    from .record import start_state
    watcher = Watcher(config=cfg, policy=policy, dirpath=dirpath, entry=entry, max_reports=max_reports,
                      argv=command, start=start_state())
    code = 0
    error = None
    with _script_environment(kind, target, args):
        with watcher:
            try:
                if kind == "script":
                    runpy.run_path(target, run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = _exit_code(exc.code)
            except KeyboardInterrupt:
                traceback.print_exc()
                code = 130
            except Stopped as exc:
                error = exc.message
                code = 1
            except BaseException as exc:  # noqa: BLE001 - the script's own error, printed as Python does
                traceback.print_exc()
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
                code = 1
            finally:
                try:
                    watcher.finish_at_exit()
                except Stopped as exc:
                    error = error or exc.message
                    code = code or 1
    written = None
    if json_out is not None and watcher.events and watcher.events[0].report:
        Path(json_out).write_text(Path(watcher.events[0].report).read_text())
        written = str(json_out)
    root = type(watcher.root).__name__ if watcher.root is not None else None
    return WatchResult(argv=tuple(command), exit_code=code, steps=watcher.steps, events=tuple(watcher.events),
                       root=root, json=written, error=error, notes=tuple(watcher.notes))


__all__ = ["watch", "WatchResult", "parse_command"]
