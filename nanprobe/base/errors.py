"""The NanprobeError tree. Each class knows its exit code; the CLI prints `str(err)`.

Message format (one line): ``<what> (<where>). <how to fix>.``
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import traceback

EXIT_OK = 0
EXIT_FOUND = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3


class NanprobeError(Exception):
    """Base class: an error the user can act on (exit code 2)."""

    exit_code = EXIT_USAGE

    def __init__(self, what: str, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(self.message)

    @property
    def message(self) -> str:
        where = f" ({self.where})" if self.where else ""
        return f"{self.what}{where}." + (f" {self.fix.rstrip('.')}." if self.fix else "")


class UsageError(NanprobeError):
    """Bad flags or option values."""


class ConfigError(NanprobeError):
    """A config file that does not parse or validate; carries every problem at once."""

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = list(problems)
        super().__init__("invalid config: " + "; ".join(self.problems), path,
                         "Fix these keys or compare with configs/default.yaml")


class EntryError(NanprobeError):
    """ENTRY cannot be found: bad syntax, missing file/module, missing function."""

    def __init__(self, what: str, entry: str, fix: str, *, path: str | None = None,
                 lineno: int | None = None):
        self.entry = entry
        self.path = path
        self.lineno = lineno
        where = f"{path}:{lineno}" if path and lineno else (path or entry)
        super().__init__(what, where, fix)


class TargetError(NanprobeError):
    """The entrypoint returned something that breaks the contract."""


class UserCodeError(NanprobeError):
    """The user's own code raised; `where` is the user's file:line."""

    def __init__(self, during: str, exc: BaseException, fix: str | None = None):
        self.during = during
        self.exc = exc
        self.path, self.lineno = user_frame(exc)
        where = f"{self.path}:{self.lineno}" if self.path else None
        detail = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__
        super().__init__(f"{during} raised {detail}", where,
                         fix or "Fix the error in your code, or rerun with --debug for the full traceback")


class UserExit(NanprobeError):
    """The user's code called ``sys.exit()`` (raised SystemExit) while nanprobe ran it: never a verdict."""

    def __init__(self, during: str, exc: BaseException, step: int | None = None):
        self.during, self.exc, self.step = during, exc, step
        self.path, self.lineno = user_frame(exc)
        code = getattr(exc, "code", None)
        where = f"{self.path}:{self.lineno}" if self.path else None
        at = f" during step {step}" if step is not None else ""
        super().__init__(f"your code called sys.exit({code!r}) in {during}{at}", where,
                         "nanprobe runs your code in its own process: let the entry function return, and raise an "
                         "exception instead of exiting")

    def at_step(self, step: int) -> UserExit:
        return self if self.step is not None else UserExit(self.during, self.exc, step)


class DataLoadError(UserCodeError):
    """The user's data pipeline raised while nanprobe fetched a batch (not a training step's error)."""


class CapsuleError(NanprobeError):
    """A capsule that is unreadable, truncated, not a capsule, or from another model."""


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the nanprobe package


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are never the user's: nanprobe, torch, the CLI stack, stdlib."""
    dirs = [_OWN_DIR, os.path.dirname(os.__file__)]
    for name in ("torch", "typer", "click", "rich", "_pytest", "pluggy", "yaml"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(mod.__file__)))
    return tuple(d + os.sep for d in dirs)


@functools.cache
def _is_library_file(filename: str) -> bool:
    if filename.startswith("<"):
        return filename.startswith("<frozen") or filename == "<string>"
    return os.path.abspath(filename).startswith(_library_dirs())


def user_frame(exc: BaseException) -> tuple[str | None, int | None]:
    """The innermost frame of an exception's traceback that belongs to the user's code."""
    found: tuple[str | None, int | None] = (None, None)
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if not _is_library_file(filename):
            found = (short_path(filename), lineno)
    if isinstance(exc, SyntaxError) and exc.filename and not _is_library_file(exc.filename):
        return short_path(exc.filename), exc.lineno
    return found


def user_source_frame() -> tuple[str | None, int | None, str | None]:
    """Walk the live stack outward to the innermost user frame: (file, line, code)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library_file(filename):
            line = linecache.getline(filename, frame.f_lineno).strip() or None
            return short_path(filename), frame.f_lineno, line
        frame = frame.f_back
    return None, None, None


def short_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies below it, else as given."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel
