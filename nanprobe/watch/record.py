"""The record a watched run leaves for `nanprobe watch --at N`: its command, its start RNG states, the
updates it skipped and each bad step's numbers (JSON lines, ``<dir>/watch-*.run.jsonl``, a line per bad
step). torch's default generator starts from the same seed in every process; Python's ``random`` and
numpy's global generator do not, so their states at the script's start are kept (JSON lists: safe to
load, nothing executed)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import random
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..base.report import StepRecord, _num

RUN_SUFFIX = ".run.jsonl"
DEFAULT_DIR = "nanprobe-reports"


# -- the first run's record: the script's start state, the bad step's numbers --------------------------------

def start_state() -> dict[str, Any]:
    """The host RNG states a script starts from (taken by ``watch`` before the script runs): JSON-able."""
    state: dict[str, Any] = {"python_random": json.loads(json.dumps(random.getstate())),   # tuples -> lists
                             "torch": torch.get_rng_state().tolist(), "threads": torch.get_num_threads(),
                             "hash_randomization": bool(sys.flags.hash_randomization),
                             "pythonhashseed": os.environ.get("PYTHONHASHSEED")}
    try:
        import numpy as np
    except ImportError:   # pragma: no cover - numpy comes with torch's usual installs
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    return state


def restore_start_state(state: dict[str, Any]) -> list[str]:
    """Put the recorded RNG states back; returns what was restored."""
    done = []
    py = state.get("python_random")
    if isinstance(py, list) and len(py) == 3:
        random.setstate((int(py[0]), tuple(int(v) for v in py[1]), py[2]))
        done.append("python random")
    t = state.get("torch")
    if isinstance(t, list) and t:
        torch.set_rng_state(torch.tensor(t, dtype=torch.uint8))
        done.append("torch")
    threads = state.get("threads")
    if isinstance(threads, int) and threads > 0 and threads != torch.get_num_threads():
        torch.set_num_threads(threads)   # bitwise reruns need the same intra-op thread count
        done.append(f"torch threads ({threads})")
    npst = state.get("numpy")
    if isinstance(npst, list) and len(npst) == 5:
        import numpy as np
        np.random.set_state((str(npst[0]), np.array(npst[1], dtype=np.uint32), int(npst[2]), int(npst[3]),
                             float(npst[4])))
        done.append("numpy")
    return done


def write_run_record(dirpath: str | os.PathLike, path: Path | None, header: dict[str, Any],
                     entry: dict[str, Any]) -> Path | None:
    """Append one bad step to the watched run's record for ``--at`` (JSON lines: the header first, with the
    command and the start RNG states; then one line per bad step, with the updates skipped since the last
    line): O(1) per bad step, whatever the number of bad steps. None when it cannot be written."""
    folder = Path(dirpath)
    try:
        if path is None:
            folder.mkdir(parents=True, exist_ok=True)
            stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
            path = folder / f"watch-{stamp}-{os.getpid()}{RUN_SUFFIX}"
            with open(path, "x") as fh:
                fh.write(json.dumps(header) + "\n")
        with open(path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        return path
    except OSError:
        return None


def read_run_record(path: Path) -> dict[str, Any] | None:
    """A run record as one dict: the header's keys, ``bad_steps`` (one entry per line) and ``skipped`` (every
    update the run skipped). None when it is not one."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    if not lines or not all(isinstance(x, dict) for x in lines):
        return None
    data = dict(lines[0])
    data["bad_steps"] = lines[1:]
    data["skipped"] = sorted({int(s) for e in lines[1:] for s in e.get("skipped", []) if isinstance(s, int)})
    return data


def at_command(step: int, argv: Sequence[str], dirpath: str | os.PathLike | None) -> str:
    """The command that explains step ``step`` of the watched script (``argv``: ``python train.py ARGS``)."""
    where = "" if dirpath is None or str(dirpath) == DEFAULT_DIR else f" --dir {shlex.quote(str(dirpath))}"
    return f"nanprobe watch --at {step}{where} -- {shlex.join(argv)}"


def record_json(record: StepRecord | None, *, weights_nonfinite: bool) -> dict[str, Any]:
    """What ``--at`` compares its rerun with: the watched step's loss, gradient norm and whether its update
    made the weights non-finite."""
    if record is None:
        return {"loss": None, "grad_norm": None, "weights_nonfinite": weights_nonfinite}
    return {"loss": _num(record.loss), "grad_norm": _num(record.grad_norm), "skipped": record.skipped,
            "weights_nonfinite": weights_nonfinite}


def _same_argv(a: Sequence[str] | None, b: Sequence[str]) -> bool:
    return bool(a) and bool(b) and len(a) == len(b) and os.path.realpath(a[0]) == os.path.realpath(b[0]) \
        and list(a[1:]) == list(b[1:])


def find_run(dirpath: str | os.PathLike, step: int, script_argv: Sequence[str], command: Sequence[str] = ()
             ) -> tuple[Path, dict[str, Any], dict[str, Any] | None] | None:
    """The newest record of a watched run of this script with these arguments in ``dirpath`` that saw step
    ``step`` bad (else the newest of any such run, with None for the step): (path, record, the step's entry)."""
    fallback = None
    for path in sorted(Path(dirpath).glob(f"*{RUN_SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True):
        data = read_run_record(path)
        if data is None or not (_same_argv(data.get("argv"), script_argv)
                                              or command and data.get("command") == list(command)):
            continue
        entry = next((b for b in data.get("bad_steps", []) if isinstance(b, dict) and b.get("step") == step), None)
        if entry is not None:
            return path, data, entry
        fallback = fallback or (path, data, None)
    return fallback


__all__ = ["start_state", "restore_start_state", "write_run_record", "read_run_record", "at_command", "record_json",
           "find_run", "RUN_SUFFIX", "DEFAULT_DIR"]
