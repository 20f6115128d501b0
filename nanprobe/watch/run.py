"""Running the watched script: the command after `--`, the script's environment, its exit code."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.errors import UsageError
from ..live import HookEvent, Stopped, check_policy, resolve_config, shown
from .launch import ProcessRow, follows, is_python, run_command
from .watcher import POLICIES, Watcher



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
    processes: tuple[ProcessRow, ...] | None = None   # a followed command's Python processes (None: in-process)
    handwritten: bool = False      # no optimizer: the update is the script's own code (each backward checked)
    unseen: tuple[str, ...] = ()   # what watch could not see, in short (the report's notes say how to cover it)

    def summary(self) -> str:
        """The one line at the end: what was watched, or a warning that nothing was."""
        if self.processes is not None:
            return _processes_summary(self)
        if self.steps == 0:
            return ("nanprobe watch: warning: no optimizer step was seen, so nothing was checked. watch guards "
                    "the steps of torch.optim optimizers (optimizer.step(), GradScaler.step) and, in a loop that "
                    "updates the weights by hand with no optimizer, each backward pass from the second on; a "
                    "script that exits before training is not seen")
        diverging = sum(1 for e in self.events if e.status == "diverging")
        bad = len(self.events) - diverging
        reports = [e for e in self.events if e.report]
        seen = f"{self.steps} backward pass(es) checked (no torch.optim optimizer: the update is written by hand, " \
            "so none could be skipped)" if self.handwritten else f"{self.steps} optimizer step(s) seen"
        return (f"nanprobe watch: 1 process, {seen}, {bad} bad step(s), "
                + (f"{diverging} slow divergence(s), " if diverging else "")
                + f"{len(reports)} report(s) written" + (f" (first: {shown(reports[0].report)})" if reports else "")
                + (f"; not seen: {'; '.join(self.unseen)}" if self.unseen else ""))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _ranks(rows: Sequence[ProcessRow]) -> str:
    ranks = sorted({r.rank for r in rows if r.rank is not None})
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f" (ranks {ranks[0]}-{ranks[-1]})"
    return f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks else ""


def _processes_summary(result: WatchResult) -> str:
    """The launcher path's line: processes (ranks), optimizer steps, bad steps, reports, failed processes."""
    rows = result.processes or ()
    if not rows:
        return ("nanprobe watch: warning: the command started no Python process nanprobe could follow, so nothing "
                "was checked. watch follows the Python processes the command starts (a rank, or the script it "
                "runs, once it imports torch) through PYTHONPATH: a program that clears it or runs Python with "
                "-E, -I or -S, or a trainer that is not Python, is not seen")
    own = [r for r in rows if r.own_watch]   # `torchrun ... nanprobe watch -- python ...`: reported by themselves
    own_line = f"{len(own)} process{'es' if len(own) != 1 else ''}{_ranks(own)} ran " \
        f"{'their' if len(own) != 1 else 'its'} own nanprobe watch (its lines above say what it saw)"
    rows = [r for r in rows if not r.own_watch]
    if own and not rows:
        return f"nanprobe watch: {own_line}"
    failed = [r for r in rows if r.exit != 0]
    # a process that took no step next to ones that did (the script that spawned its ranks) is not counted
    rows = [r for r in rows if r.steps] or rows
    procs = f"{len(rows)} process{'es' if len(rows) != 1 else ''}{_ranks(rows)}"
    tail = "".join(f"; {'rank ' + str(r.rank) if r.rank is not None else 'pid ' + str(r.pid)} "
                   + (f"exited {r.exit}" if r.exit is not None else "was killed before it exited")
                   + (f" ({r.error})" if r.error else "") for r in failed[:2]) + (f"; {own_line}" if own else "")
    if result.steps == 0:
        return (f"nanprobe watch: warning: {procs} followed, but no optimizer step was seen, so nothing was "
                "checked. watch guards the steps of torch.optim optimizers (optimizer.step(), GradScaler.step); an "
                "update written by hand (p -= lr * p.grad) or a script that exits before training is not seen: "
                "use nanprobe.Guard in such a loop" + tail)
    counts = {r.steps for r in rows}
    steps = f"{_plural(rows[0].steps, 'optimizer step')} seen in each" if len(rows) > 1 and len(counts) == 1 else \
        f"{_plural(result.steps, 'optimizer step')} seen"
    # a step every rank of one job skipped together is one bad step; separate jobs' steps are their own
    bad = len({(e.step,) if (r.world_size or 1) > 1 else (r.pid, e.step) for r in rows for e in r.events})
    reports = [e for e in result.events if e.report]
    first = f" (first: {shown(_first_report(result.events).report)})" if reports else ""
    return (f"nanprobe watch: {procs}, {steps}, {_plural(bad, 'bad step')}, {_plural(len(reports), 'report')} "
            f"written{first}" + tail)


# -- the command line after `--` ----------------------------------------------------------------------

def parse_command(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """``python train.py ARGS`` / ``python -m pkg.train ARGS`` -> (kind, target, args)."""
    argv = list(argv)
    if not argv:
        raise UsageError("no command to watch", "nanprobe watch", "Give it after --: nanprobe watch -- python "
                                                                   "train.py ARGS")
    if not is_python(argv[0]):
        raise UsageError(f"{argv[0]!r} is not a Python interpreter", "nanprobe watch",
                         "Watch a Python script: nanprobe watch -- python train.py ARGS (or python -m pkg.train); "
                         "a launcher's processes: nanprobe watch -- torchrun ... train.py")
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
    sys.argv = [target, *args]
    if kind == "script":
        sys.path[:1] = [str(Path(target).resolve().parent)]
    elif os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.argv = argv
        if path0 is not None and sys.path:
            sys.path[0] = path0


def run_script(kind: str, target: str) -> None:
    """Run the script as ``python train.py`` / ``python -m pkg.train`` would (in its environment)."""
    if kind == "script":
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def print_error(exc: BaseException) -> str:
    """Print the script's own error as Python does; returns its one line."""
    traceback.print_exc()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")


def no_json_dash(json_out: str | os.PathLike | None) -> None:
    if json_out is not None and str(json_out) == "-":
        raise UsageError("--json - would mix the report with the script's output", "--json",
                         "Give a file: --json report.json")


def _exit_code(code: Any) -> int:
    """``sys.exit(code)``'s exit status, as Python's: a code that is not a number is printed, status 1."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code or 0


def watch(command: Sequence[str], *, json_out: str | os.PathLike | None = None, policy: str = "skip",
          config: Any = None, dirpath: str | os.PathLike = "nanprobe-reports", entry: str | None = None,
          check_every: int | None = None, max_reports: int = 1) -> WatchResult:
    """Run ``python train.py ARGS`` (or ``python -m pkg.train ARGS``) in this process under the guard.

    The script's output goes where it would; its exit code is the result's (an exception it raises is
    printed as Python would, exit code 1). Bad steps are logged on the ``nanprobe.watch`` logger.

    Any other command (``torchrun ...``, ``accelerate launch ...``, ``python -m torch.distributed.run ...``,
    ``bash run.sh``) runs as a subprocess whose Python processes are followed (:mod:`nanprobe.watch.launch`):
    the result's exit code is the command's, its ``processes`` one row per watched process, its events
    every process's bad steps; ``json_out`` gets the report of the rank that saw the first one.
    """
    check_policy(policy, POLICIES, "--policy")
    launched = follows(command)   # a launcher (torchrun, accelerate launch, bash ...): its Python processes
    kind, target, args = ("", "", []) if launched else parse_command(command)
    cfg = resolve_config(config, "nanprobe watch", check_every=check_every)
    no_json_dash(json_out)
    if isinstance(max_reports, bool) or not isinstance(max_reports, int) or max_reports < 0:
        raise UsageError(f"--max-reports {max_reports!r}", "nanprobe watch",
                         "Give the number of bad steps to diagnose in-process (0: none, only capsules)")
    if launched:   # the command as a subprocess, its Python processes followed (nanprobe.watch.launch)
        code, rows = run_command(command, cfg=cfg, policy=policy, dirpath=dirpath, entry=entry,
                                 max_reports=max_reports)
        events = tuple(sorted((e for r in rows for e in r.events), key=lambda e: (e.step, e.rank)))
        return WatchResult(argv=tuple(command), exit_code=code, steps=sum(r.steps for r in rows), events=events,
                           root=next((r.root for r in rows if r.root), None),
                           json=_copy_report(json_out, _first_report(events)),
                           notes=tuple(dict.fromkeys(n for r in rows for n in r.notes)), processes=rows)
    from .record import start_state
    watcher = Watcher(config=cfg, policy=policy, dirpath=dirpath, entry=entry, max_reports=max_reports,
                      argv=command, start=start_state())
    code = 0
    error = None
    with _script_environment(kind, target, args), watcher:
        try:
            run_script(kind, target)
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 130
        except Stopped as exc:
            error = exc.message
            code = 1
        except BaseException as exc:  # noqa: BLE001 - the script's own error, printed as Python does
            error, code = print_error(exc), 1
        finally:
            try:
                watcher.finish_at_exit()
            except Stopped as exc:
                error = error or exc.message
                code = code or 1
    return WatchResult(argv=tuple(command), exit_code=code, steps=watcher.steps, events=tuple(watcher.events),
                       handwritten=watcher.handwritten, unseen=tuple(short for short, _ in watcher.unseen()),
                       root=type(watcher.root).__name__ if watcher.root is not None else None, error=error,
                       json=_copy_report(json_out, watcher.events[0] if watcher.events else None),
                       notes=tuple(watcher.notes))


def _copy_report(json_out: str | os.PathLike | None, event: HookEvent | None) -> str | None:
    """--json OUT: a copy of the bad step's report (where it has one)."""
    if json_out is None or event is None or not event.report:
        return None
    Path(json_out).write_text(Path(event.report).read_text())
    return str(json_out)


def _first_report(events: Sequence[HookEvent]) -> HookEvent | None:
    """The first bad step's report, of the rank that saw it (the others skipped the step with it)."""
    return next((e for e in events if e.report and e.local), next((e for e in events if e.report), None))


__all__ = ["watch", "WatchResult", "parse_command", "is_python"]
