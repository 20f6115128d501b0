"""ENTRY ("path/to/file.py:fn" or "pkg.module:fn") -> a validated Target with its provenance."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..base.errors import EntryError, short_path
from .target import Target, call_user, to_device, validate


@dataclass(frozen=True, slots=True, kw_only=True)
class Loaded:
    target: Target
    entry: str          # as the user wrote it
    module: str         # module name it was imported as
    function: str
    path: str | None    # source file of the function
    lineno: int | None  # line of the function definition

    @property
    def where(self) -> str:
        return f"{self.path}:{self.lineno}" if self.path else self.entry


def split_entry(entry: str) -> tuple[str, str]:
    if ":" not in entry or entry.endswith(":") or entry.startswith(":"):
        raise EntryError(f"ENTRY {entry!r} names no function", entry,
                         "Write it as path/to/train.py:function or package.module:function")
    ref, func = entry.rsplit(":", 1)
    if not func.isidentifier():
        raise EntryError(f"ENTRY function {func!r} is not a Python name", entry,
                         "Write it as path/to/train.py:function or package.module:function")
    return ref, func


def _import_file(ref: str, entry: str) -> ModuleType:
    path = Path(ref)
    if not path.is_file():
        hint = "Check the path" if path.suffix == ".py" else "Point at a .py file"
        raise EntryError(f"file {ref!r} not found", entry, f"{hint} (relative to {os.getcwd()})")
    path = path.resolve()
    name = "nanprobe_entry_" + hashlib.sha1(str(path).encode()).hexdigest()[:10]
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the script's sibling imports work, as under `python file.py`
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise EntryError(f"cannot import {ref!r}", entry, "Point at a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        call_user(f"importing {ref}", spec.loader.exec_module, module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import_module(ref: str, entry: str) -> ModuleType:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(ref)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise EntryError(f"module {ref!r} not found", entry,
                         "Check the name and that its package is importable (pip install -e . or run from its folder)")
    return call_user(f"importing {ref}", importlib.import_module, ref)


def load_target(entry: str, config: dict | None = None, device: str | None = None) -> Loaded:
    """Import ENTRY, call its function (with ``config`` if it takes one) and validate the result.

    ``device`` moves the model, optimizer state and batches there (``--device cuda``).
    """
    ref, func_name = split_entry(entry)
    is_path = ref.endswith(".py") or os.sep in ref or "/" in ref
    module = _import_file(ref, entry) if is_path else _import_module(ref, entry)
    fn = getattr(module, func_name, None)
    if fn is None:
        candidates = [n for n, v in vars(module).items()
                      if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")]
        hint = f"Functions there: {', '.join(candidates)}" if candidates else "Define it in that module"
        raise EntryError(f"no function {func_name!r} in {ref if is_path else module.__name__}", entry, hint,
                         path=getattr(module, "__file__", None) and short_path(module.__file__))
    if not callable(fn):
        raise EntryError(f"{func_name!r} is a {type(fn).__name__}, not a function", entry,
                         "Point ENTRY at a function that returns a nanprobe.Target or a dict")
    path, lineno = _source(fn)
    result = call_user(f"{func_name}()", fn, *_arguments(fn, config, entry, path, lineno))
    target = validate(result, f"{path}:{lineno}" if path else entry)
    if device is not None:
        to_device(target, device)
    return Loaded(target=target, entry=entry, module=module.__name__, function=func_name,
                  path=path, lineno=lineno)


def _arguments(fn: Any, config: dict | None, entry: str, path: str | None, lineno: int | None) -> tuple:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ()
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 1:
        raise EntryError(f"{entry} takes {len(required)} required arguments", entry,
                         "The entry function takes no arguments, or one optional config dict",
                         path=path or entry.rsplit(":", 1)[0], lineno=lineno)
    if config is not None and positional:
        return (config,)
    return ({},) if required else ()


def _source(fn: Any) -> tuple[str | None, int | None]:
    try:
        file = inspect.getsourcefile(fn)
        _, lineno = inspect.getsourcelines(fn)
    except (TypeError, OSError):
        return None, None
    return (short_path(file) if file else None), lineno


