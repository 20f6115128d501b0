"""One line in the user's trainer: `nanprobe.integrations.lightning.NanprobeCallback` for
``lightning.Trainer``, `nanprobe.integrations.transformers.NanprobeCallback` for
``transformers.Trainer`` (and ``nanprobe watch`` for scripts with their own loop).

Each guards every optimizer step through the framework's hooks (:mod:`nanprobe.live`) and diagnoses
the first bad step in the training process with the framework's own step as a ``step_fn``.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import the framework, or stop with one line on stderr and exit code 2 (the extra to install)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f"nanprobe: error: {what} needs {module.split('.')[0]}, which is not installed ({module}). "
              f"Install it: pip install 'nanprobe[{extra}]'.", file=sys.stderr)
        raise SystemExit(2) from None


__all__ = ["require"]
