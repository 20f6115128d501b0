"""Helpers for users' own test suites: a few training steps must stay finite.

    from nanprobe.testing import assert_trains_finite

    def test_model_trains_finite():
        assert_trains_finite("train.py:target", steps=20, precision="bf16")
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import replace
from typing import Any

from .base.config import Config
from .base.precision import Precision
from .pipeline.smoke import SmokeResult, smoke


def assert_trains_finite(entry_or_target: Any, steps: int = 20, precision: str | Precision | None = None, *,
                         config: Config | None = None, capsule_dir: str | os.PathLike | None = None) -> SmokeResult:
    """Train ``steps`` steps from scratch under nanprobe.Guard; AssertionError with the diagnosis otherwise.

    ``entry_or_target``: an ENTRY string ("train.py:target"), a nanprobe.Target, a dict, or a
    function returning one (a function or ENTRY lets nanprobe rebuild the objects to replay).
    Capsules go to a temporary folder unless ``capsule_dir`` is given. Returns the SmokeResult
    when healthy. Entry errors raise nanprobe's own errors (a broken test setup, not a failure).
    """
    with (contextlib.nullcontext(capsule_dir) if capsule_dir is not None
          else tempfile.TemporaryDirectory(prefix="nanprobe-capsules-")) as folder:
        result = smoke(entry_or_target, steps=steps, precision=precision, config=config, capsule_dir=folder)
    if not result.healthy and capsule_dir is None:   # the temporary folder, and its capsule, are gone
        result = replace(result, capsule=None, command=None,
                         notes=result.notes + ("pass capsule_dir= to keep the capsule of the bad step",))
    if not result.healthy:
        raise AssertionError("nanprobe: training is not finite\n" + result.summary())
    return result


__all__ = ["assert_trains_finite"]
