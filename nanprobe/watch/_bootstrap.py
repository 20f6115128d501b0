"""The bootstrap every Python child of ``nanprobe watch -- LAUNCHER ...`` inherits (see nanprobe.watch.launch).

Copied as ``sitecustomize.py`` into a folder prepended to ``PYTHONPATH``, it runs :func:`boot` in every
interpreter the command starts (torchrun's agent and its ranks, a shell script's ``python train.py``) with
the standard library only until the process trains. It chains to the ``sitecustomize`` it shadows; with
``NANPROBE_WATCH_RUN`` set, once ``torch`` is imported the first optimizer the process builds starts a
:class:`nanprobe.watch.Watcher` (a launcher or a DataLoader worker builds none and stays inert; a process
forked while a Watcher runs removes its hooks at once). At exit (``atexit``) it finishes the Watcher and
writes the process's row into the run directory; a process with a Watcher also writes it when the Watcher
starts and after each bad step, so a rank the launcher kills (SIGTERM skips ``atexit``) is still counted.
A process with no optimizer writes a row only if it runs the user's script (a rank, or the script a shell
command runs), never a launcher, a multiprocessing child or a helper interpreter (``python -c``).

Nothing here may raise into the user's program: every step is wrapped.
"""

from __future__ import annotations

import os
import sys

RUN_ENV = "NANPROBE_WATCH_RUN"          # the run directory (rows go there)
SETTINGS_ENV = "NANPROBE_WATCH"         # JSON: policy, dirpath, max_reports, entry, config, path
RUN_PREFIX = "nanprobe-watch-"          # the run directory's name; its bootstrap/ holds this file
# `python -m` mains that are not the user's script: launchers, torch's own workers (inductor's compile workers)
_NOT_SCRIPTS = ("torch.", "accelerate.", "deepspeed.")


class _State:
    pid = os.getpid()
    armed = False          # Optimizer.__init__ is wrapped
    inert = False          # a child forked from a watched process: nothing at all
    own_watch = False      # the process runs `nanprobe watch -- python ...` itself: its row says only that
    watcher = None
    exit_code = None       # sys.exit's code, or 1 after an uncaught exception (`raise SystemExit(n)`: not seen)
    error = None


def _chain(here: str) -> None:
    """Run the ``sitecustomize`` this file shadows (the next one on sys.path), as Python would have."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    while True:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is None or spec.loader is None:
            return
        folder = os.path.dirname(os.path.abspath(spec.origin or ""))
        if not os.path.basename(os.path.dirname(folder)).startswith(RUN_PREFIX):
            break
        path = [p for p in path if os.path.abspath(p or ".") != folder]   # an outer watch's bootstrap: one is enough
    module = importlib.util.module_from_spec(spec)
    sys.modules["_nanprobe_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


class _TorchLoader:
    """torch's own loader (its other methods through ``__getattr__``); once torch's module has run,
    :func:`_on_torch`."""

    def __init__(self, loader):
        self._loader = loader

    def exec_module(self, module):
        self._loader.exec_module(module)
        _on_torch()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _TorchFinder:
    """Finds nothing itself: gives torch's spec the loader above, once."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _TorchLoader(spec.loader)
        return spec


def _on_torch() -> None:
    """torch is imported: wrap Optimizer.__init__ (the first optimizer starts the Watcher), note how the
    process exits."""
    if _State.armed or _State.inert:
        return
    try:
        import torch.optim
        original = torch.optim.Optimizer.__init__

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if _State.watcher is None and not _State.inert:
                torch.optim.Optimizer.__init__ = original   # one call: the rest is the Watcher's
                _start()

        torch.optim.Optimizer.__init__ = __init__
        _State.armed = True
        _wrap_exit()
    except Exception:  # noqa: BLE001 - never break the user's program
        pass


def _start() -> None:
    """Start the Watcher (same code as ``nanprobe watch -- python train.py``) in this process."""
    if _in_process_watch():
        _State.own_watch = True   # that watch guards and reports this process itself
        return
    try:
        import importlib.util
        import json

        settings = json.loads(os.environ.get(SETTINGS_ENV) or "{}")
        if settings.get("path") and importlib.util.find_spec("nanprobe") is None:
            sys.path.append(settings["path"])
        from nanprobe.watch.child import start_watcher
        _State.watcher = start_watcher(settings, on_event=_progress)
        _progress()   # counted even if the launcher kills it before it exits
    except Exception as exc:  # noqa: BLE001 - the user's training goes on, unwatched; the row says why
        _State.error = f"nanprobe could not start: {type(exc).__name__}: {exc}"


def _in_process_watch() -> bool:
    """A Watcher is installed in this process already (``nanprobe watch -- python train.py`` run in-process
    under an outer watch): that one guards the steps."""
    from torch.optim import optimizer

    hooks = getattr(optimizer, "_global_optimizer_pre_hooks", {})
    return any(type(getattr(h, "__self__", None)).__name__ == "Watcher" for h in list(hooks.values()))


def _wrap_exit() -> None:
    hook, exit_ = sys.excepthook, sys.exit

    def excepthook(kind, value, tb):
        _State.exit_code = 130 if issubclass(kind, KeyboardInterrupt) else 1
        line = str(value).splitlines()[0] if str(value) else ""
        _State.error = f"{kind.__name__}: {line}".rstrip(": ")
        if kind.__name__ == "Stopped" and kind.__module__.startswith("nanprobe."):
            # policy raise (or weights already non-finite): one line, as in-process, no traceback
            _State.error = f"{value.what} ({value.where})" if getattr(value, "where", None) else value.what
            print(value, file=sys.stderr)
            return
        hook(kind, value, tb)

    def exit(code=None):
        _State.exit_code = 0 if code is None else code if isinstance(code, int) else 1
        exit_(code)

    sys.excepthook, sys.exit = excepthook, exit


def _forked() -> None:
    """A child forked while a Watcher runs (a DataLoader worker): remove its hooks, write nothing."""
    if _State.watcher is None:
        _State.pid = os.getpid()   # forked before training began: it may train itself
        return
    _State.inert = True
    try:
        _State.watcher.__exit__()
    except Exception:  # noqa: BLE001
        pass


def _launched_script() -> bool:
    """The process runs the user's script (``python train.py``, ``python -m pkg.train``), not a launcher."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return not spec.name.startswith(_NOT_SCRIPTS)
    return bool(sys.argv) and sys.argv[0].endswith(".py")   # not "-c", not a launcher's console script


def _progress() -> None:
    """The row so far (exit unknown): written when the Watcher starts and after each bad step."""
    if _State.inert or os.getpid() != _State.pid or _State.watcher is None:
        return
    from nanprobe.watch.child import watcher_row
    _write_row(watcher_row(_State.watcher), exited=False)


def _write_row(row: dict, exited: bool) -> None:
    import json

    row.update(pid=os.getpid(), argv=list(sys.argv), error=_State.error or row.get("error"),
               exit=(0 if _State.exit_code is None else _State.exit_code) if exited else None,
               own_watch=_State.own_watch, rank=_env_int("RANK", row.get("rank")),
               world_size=_env_int("WORLD_SIZE", row.get("world_size")))
    folder = os.environ[RUN_ENV]
    tmp = os.path.join(folder, f".process-{os.getpid()}.json")
    with open(tmp, "w") as fh:
        json.dump(row, fh)
    os.replace(tmp, os.path.join(folder, f"process-{os.getpid()}.json"))


def _at_exit() -> None:
    if _State.inert or os.getpid() != _State.pid or "torch" not in sys.modules:
        return
    try:
        import multiprocessing

        w = _State.watcher
        row = None
        if w is not None:
            from nanprobe.watch.child import finish_watcher
            row = finish_watcher(w)
        # `nanprobe watch -- LAUNCHER ...` run under an outer watch: it followed (and reported) its own processes
        _State.own_watch = _State.own_watch or bool(getattr(sys.modules.get("nanprobe.watch.launch"), "followed", 0))
        # no optimizer: a row only for the user's script itself (a rank that updates by hand, one that stopped
        # early), never for a launcher, a multiprocessing child or a helper interpreter (`-c`, torch's workers)
        if w is None and not _State.own_watch and (multiprocessing.parent_process() is not None or
                                                   not _launched_script()):
            return
        _write_row(row or {"steps": 0, "events": [], "root": None, "notes": []}, exited=True)
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _env_int(name: str, default):
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def boot(here: str) -> None:
    try:
        _chain(here)
    finally:
        if os.environ.get(RUN_ENV):
            import atexit

            if hasattr(os, "register_at_fork"):   # POSIX
                os.register_at_fork(after_in_child=_forked)
            atexit.register(_at_exit)
            if "torch" in sys.modules:
                _on_torch()
            else:
                sys.meta_path.insert(0, _TorchFinder())


if __name__ == "sitecustomize":
    boot(os.path.dirname(os.path.abspath(__file__)))
