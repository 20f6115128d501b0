"""In a child process of `nanprobe watch -- LAUNCHER ...`: the Watcher the bootstrap (sitecustomize) starts
when the first optimizer is built, and the row it writes for the parent at exit (see :mod:`.launch`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import Any

from ..live import Stopped, resolve_config


def log_to_stderr(log: logging.Logger) -> logging.Handler:
    """The Watcher's lines on stderr, one message a line, as under the CLI (not propagated further up)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.propagate = False
    return handler


def start_watcher(settings: dict[str, Any], on_event: Callable[[], None] | None = None):
    """In a child process, when it builds its first optimizer: a Watcher with the parent's settings,
    installed; its log lines go to stderr as under the CLI, and ``on_event`` is called with each."""
    from .watcher import Watcher

    log = logging.getLogger("nanprobe.watch")
    if not log.handlers:
        log_to_stderr(log)
    # on each line the Watcher logs (a bad step) the bootstrap rewrites the process's row, so a rank the launcher
    # kills (SIGTERM: no ``atexit``) still shows its bad steps
    if on_event is not None:
        def notify(record: logging.LogRecord) -> bool:
            with contextlib.suppress(Exception):   # never into the user's training
                on_event()
            return True
        log.addFilter(notify)
    watcher = Watcher(config=resolve_config(settings.get("config"), "nanprobe watch"),
                      policy=settings.get("policy", "skip"), dirpath=settings.get("dirpath", "nanprobe-reports"),
                      entry=settings.get("entry"), max_reports=int(settings.get("max_reports", 1)))
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
    rank, world = getattr(getattr(watcher.guard, "core", None), "_world", None) or (None, None)
    if world is not None and world <= 1:
        rank = world = None
    return {"steps": watcher.steps, "events": [dataclasses.asdict(e) for e in watcher.events],
            "root": type(watcher.root).__name__ if watcher.root is not None else None,
            "notes": list(watcher.notes), "error": None, "rank": rank, "world_size": world}


__all__ = ["start_watcher", "finish_watcher", "watcher_row", "log_to_stderr"]
