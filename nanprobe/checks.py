"""Per-batch data checks shared by `run` (the diagnosed batch) and `scan-data` (every batch).

All reductions of one batch are stacked and read back with a single device sync; sample
indices are computed only for tensors that have a problem.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from .batch import iter_tensors, key_name

LABEL_KEYS = re.compile(r"(^|_)(label|labels|target|targets|y|tag|tags|class|classes)($|_)", re.I)
MASK_KEYS = re.compile(r"mask", re.I)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataProblem:
    code: str               # nonfinite | empty | beyond_range | label_negative | label_out_of_range |
                            # all_ignored | masked_row | outlier | constant
    level: str              # "error" | "warning"
    step: int | None
    key: str                # batch key path, e.g. batch["input_ids"]
    count: int              # elements (or rows) affected
    samples: tuple[int, ...]  # first sample indices (dim 0)
    value: float | None     # an example value
    message: str

    def to_json(self) -> dict[str, Any]:
        value = self.value
        if value is not None and not math.isfinite(value):
            value = str(value)
        return {"code": self.code, "level": self.level, "step": self.step, "key": self.key, "count": self.count,
                "samples": list(self.samples), "value": value, "message": self.message}


def is_label_key(path: str) -> bool:
    return bool(LABEL_KEYS.search(key_name(path)))


def is_mask_key(path: str) -> bool:
    return bool(MASK_KEYS.search(key_name(path)))


def _masked_rows(key: str, mask: torch.Tensor) -> torch.Tensor:
    """Rows (last axis) that attend to nothing. ``*pad*`` masks mark padding with True
    (PyTorch's key_padding_mask); other masks mark positions to keep (Hugging Face attention_mask)."""
    m = mask.bool()
    if "pad" in key_name(key).lower():
        return m.all(-1)
    return ~m.any(-1)


def _rows(bad: torch.Tensor, limit: int) -> tuple[int, ...]:
    if bad.dim() == 0:
        return ()
    rows = bad.reshape(bad.shape[0], -1).any(1) if bad.dim() > 1 else bad
    return tuple(int(i) for i in rows.nonzero().flatten()[:limit].tolist())


def check_batch(batch: Any, *, step: int | None = None, ignore_index: int = -100, num_classes: int | None = None,
                range_max: float | None = None, max_examples: int = 5) -> list[DataProblem]:
    """Problems in one batch that turn into NaN/Inf in training.

    ``range_max`` is the largest finite value of the training precision (65504 for fp16):
    floating values beyond it become inf on the autocast cast.
    """
    tensors = list(iter_tensors(batch))
    problems: list[DataProblem] = []
    checks: list[tuple[str, str, torch.Tensor]] = []   # (code, key, bool/number tensor on device)
    for key, t in tensors:
        if t.numel() == 0:
            problems.append(DataProblem(code="empty", level="error", step=step, key=key, count=0, samples=(),
                                        value=None, message=f"{key} is empty (shape {tuple(t.shape)}): a mean over "
                                                            "it is 0/0 = NaN"))
            continue
        if t.dim() >= 2 and 0 in t.shape[1:]:
            problems.append(DataProblem(code="empty", level="error", step=step, key=key, count=t.shape[0], samples=(),
                                        value=None, message=f"{key} has zero-length sequences (shape "
                                                            f"{tuple(t.shape)})"))
            continue
        x = t.detach()
        if x.is_floating_point():
            finite = torch.isfinite(x)
            checks.append(("nonfinite", key, (~finite).sum()))
            if range_max is not None:
                checks.append(("beyond_range", key, (finite & (x.abs() > range_max)).sum()))
        elif not x.dtype.is_complex and x.dtype != torch.bool and is_label_key(key):
            ignored = x == ignore_index
            checks.append(("all_ignored", key, ignored.all()))
            checks.append(("label_negative", key, ((x < 0) & ~ignored).sum()))
            if num_classes is not None:
                checks.append(("label_out_of_range", key, ((x >= num_classes) & ~ignored).sum()))
        if is_mask_key(key) and x.dim() >= 2 and not x.is_floating_point():
            checks.append(("masked_row", key, _masked_rows(key, x).sum()))
    if not checks:
        return problems
    values = torch.stack([c[2].float().cpu() for c in checks]).tolist()
    by_key = dict(tensors)
    for (code, key, _), value in zip(checks, values):
        if value == 0:
            continue
        t = by_key[key].detach()
        count = int(value)
        if code == "nonfinite":
            bad = ~torch.isfinite(t)
            example = float(t[bad].flatten()[0])
            problems.append(DataProblem(code=code, level="error", step=step, key=key, count=count,
                                        samples=_rows(bad, max_examples), value=example,
                                        message=f"{key} holds {count} non-finite value(s) ({example})"))
        elif code == "beyond_range":
            bad = torch.isfinite(t) & (t.abs() > range_max)
            example = float(t[bad].flatten()[0])
            problems.append(DataProblem(code=code, level="error", step=step, key=key, count=count,
                                        samples=_rows(bad, max_examples), value=example,
                                        message=f"{key} holds {count} value(s) beyond ±{range_max:g} (e.g. "
                                                f"{example:g}): they become inf when cast to the training precision"))
        elif code == "all_ignored":
            problems.append(DataProblem(code=code, level="error", step=step, key=key, count=t.numel(), samples=(),
                                        value=float(ignore_index),
                                        message=f"every label in {key} is the ignore index {ignore_index}: a mean "
                                                "cross-entropy over no labels is 0/0 = NaN"))
        elif code == "label_negative":
            bad = (t < 0) & (t != ignore_index)
            example = float(t[bad].flatten()[0])
            problems.append(DataProblem(code=code, level="error", step=step, key=key, count=count,
                                        samples=_rows(bad, max_examples), value=example,
                                        message=f"{key} holds {count} negative label(s) (e.g. {example:g}) other than "
                                                f"the ignore index {ignore_index}"))
        elif code == "label_out_of_range":
            bad = (t >= num_classes) & (t != ignore_index)
            example = float(t[bad].flatten()[0])
            problems.append(DataProblem(code=code, level="error", step=step, key=key, count=count,
                                        samples=_rows(bad, max_examples), value=example,
                                        message=f"{key} holds {count} label(s) >= num_classes {num_classes} "
                                                f"(e.g. {example:g})"))
        elif code == "masked_row":
            rows_bad = _masked_rows(key, t)
            problems.append(DataProblem(code=code, level="error", step=step, key=key, count=count,
                                        samples=_rows(rows_bad, max_examples), value=None,
                                        message=f"{key} masks out every position of {count} row(s): attention over "
                                                "nothing is 0/0 = NaN"))
    return problems
