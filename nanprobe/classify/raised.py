"""When the user's step raised: what the exception means, as a cause.

Many training failures raise before any NaN exists: an index past an embedding table, a label
past the classes, ``binary_cross_entropy`` on logits, a ``-1e9`` that does not fit fp16. Each
entry maps an exception message to findings, using the op that raised (``Trace.failed``: its
module, source line and input range) and the step's batch. A raise no entry explains stays a bug
in the user's code (exit 2).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from ..base.batch import iter_tensors
from ..base.errors import UserCodeError
from ..locate.instrument import LOSS_FN, Failed
from ..base.report import Cause, Finding, Phase
from .core import Evidence, finding, g, rule

Explain = Callable[[Evidence, "re.Match[str]"], "list[Finding]"]
_ERRORS: list[tuple[re.Pattern[str], Explain]] = []


def on_error(pattern: str) -> Callable[[Explain], Explain]:
    """Register what an exception whose ``Type: message`` matches ``pattern`` means."""
    def deco(fn: Explain) -> Explain:
        _ERRORS.append((re.compile(pattern), fn))
        return fn
    return deco


def _entry(error: UserCodeError | None) -> tuple[Explain, re.Match[str]] | None:
    """The first registered entry whose pattern matches the exception's ``Type: message``, and its match."""
    if error is None:
        return None
    text = f"{type(error.exc).__name__}: {error.exc}"
    return next(((fn, m) for pat, fn in _ERRORS if (m := pat.search(text))), None)


def explains(error: UserCodeError | None) -> bool:
    """Whether a registered entry gives the step's exception a cause (else it is a bug: exit 2)."""
    return _entry(error) is not None


def explained_by(error: UserCodeError | None) -> str | None:
    """The name of the entry that explains the exception (the fix catalog adapts to it)."""
    hit = _entry(error)
    return hit[0].__name__ if hit is not None else None


@rule
def raised_rule(ev: Evidence) -> list[Finding]:
    hit = _entry(ev.reached.error)
    return hit[0](ev, hit[1]) if hit is not None else []


def _failed(ev: Evidence) -> Failed | None:
    return ev.main.trace.failed if ev.main.trace is not None else None


def _at(f: Failed | None) -> str:
    if f is None:
        return ""
    src = f" at {f.source}" if f.source else ""
    return f" ({f.op} in {f.module or '(model)'}{src})"


def _first_line(ev: Evidence) -> str:
    err = ev.reached.error
    what = str(err.exc).strip().splitlines()[0] if str(err.exc).strip() else ""
    where = f" at {err.path}:{err.lineno}" if err.path and _failed(ev) is None else ""
    return (f"step {ev.reached.step} raised before any NaN existed: {err.during} raised "
            f"{type(err.exc).__name__}: {what}{where}{_at(_failed(ev))}")


@on_error(r"IndexError: index out of range in self")
def embedding_index(ev: Evidence, m: re.Match[str]) -> list[Finding]:
    """An id past an embedding table: find the table and the batch key and samples that hold it."""
    f = _failed(ev)
    modules = dict(ev.target.model.named_modules())
    table = modules.get(f.module) if f is not None and f.module else None
    rows = getattr(table, "num_embeddings", None)
    lines = [_first_line(ev)]
    conf = 0.7
    if rows is not None:
        for key, t in iter_tensors(ev.reached.batch):
            if t.is_floating_point() or t.dtype == torch.bool or t.numel() == 0:
                continue
            bad = (t >= rows) | (t < 0)
            if bool(bad.any()):
                samples = bad.reshape(t.shape[0], -1).any(1).nonzero().flatten()[:5].tolist() if t.dim() else []
                lines.append(f"{key} holds id {int(t[bad].max() if bool((t >= rows).any()) else t[bad].min())} "
                             f"(samples {samples}) but {f.module} has {rows} rows (ids 0..{rows - 1})")
                conf = 0.95
                break
    lines.append("an id the table does not have: a tokenizer with added (special) tokens whose embedding was not "
                 "resized, or ids from another vocabulary")
    return [finding(Cause.DATA, conf, None, lines, phase=Phase.INPUT)]


def holding(batch, value: int) -> tuple[str, list[int]] | None:
    """The first integer tensor of the batch that holds ``value``: its key path and sample rows."""
    for key, t in iter_tensors(batch):
        if t.is_floating_point() or t.dtype == torch.bool or t.numel() == 0 or t.dim() == 0:
            continue
        hit = t == value
        if bool(hit.any()):
            return key, hit.reshape(t.shape[0], -1).any(1).nonzero().flatten()[:5].tolist()
    return None


LABEL_OUT_OF_RANGE = r"Target (-?\d+) is out of bounds"   # cross_entropy / nll_loss on a label >= C


@on_error(LABEL_OUT_OF_RANGE)
def label_out_of_range(ev: Evidence, m: re.Match[str]) -> list[Finding]:
    value = int(m.group(1))
    lines = [_first_line(ev), f"label {value} is not a class of the model's output (and not ignore_index "
                              f"{ev.target.ignore_index})"]
    found = holding(ev.reached.batch, value)
    if found is not None:
        lines.append(f"{found[0]} holds label {value} (samples {found[1]})")
    return [finding(Cause.DATA, 0.9 if found else 0.85, None, lines, phase=Phase.INPUT)]


@on_error(r"all elements of (input|target) should be between 0 and 1")
def bce_outside_unit_interval(ev: Evidence, m: re.Match[str]) -> list[Finding]:
    if ev.origin is not None:
        return []   # a NaN reached it: the origin explains the step
    f = _failed(ev)
    what = m.group(1)
    stats = f.inputs[0 if what == "input" else 1] if f is not None and len(f.inputs) > (what != "input") else None
    lo, hi = (stats.min, stats.max) if stats is not None else (None, None)
    rng = f" ranges from {g(lo)} to {g(hi)}" if lo is not None else " is outside [0, 1]"
    lines = [_first_line(ev), f"binary_cross_entropy needs probabilities in [0, 1]; its {what}{rng}"]
    if what == "target":
        return [finding(Cause.DATA, 0.9, None, lines, phase=Phase.INPUT)]
    lines.append("these are logits (or scores), not probabilities: binary_cross_entropy_with_logits takes them "
                 "as they are, and is stable where sigmoid + BCE is not")
    return [finding(Cause.DOMAIN, 0.9, None, lines, phase=f.phase if f else Phase.FORWARD,
                    module=f.module if f else LOSS_FN, op=f.op if f else None)]


@on_error(r"value cannot be converted to type (\S+) without overflow")
def constant_beyond_dtype(ev: Evidence, m: re.Match[str]) -> list[Finding]:
    f = _failed(ev)
    dtype = m.group(1).replace("c10::", "").replace("at::", "")
    lines = [_first_line(ev), f"a Python constant does not fit {dtype} (float16 max 65504): a hard-coded -1e9 / "
                              "1e10 used under fp16 autocast (masked_fill, fill_, clamp)"]
    if f is not None and f.code:
        lines.append(f"code: {f.code}")
    return [finding(Cause.OVERFLOW, 0.93, None, lines, phase=f.phase if f else Phase.FORWARD,
                    module=f.module if f else None, op=f.op if f else None)]


@on_error(r"Expected (input|target)_lengths|(input|target)_lengths must|input length .* target length")
def ctc_lengths(ev: Evidence, m: re.Match[str]) -> list[Finding]:
    return [finding(Cause.DATA, 0.85, None, [_first_line(ev), "ctc_loss got lengths that do not fit the "
                                             "tensors: input_lengths past the time axis, or target_lengths past "
                                             "the targets"], phase=Phase.INPUT)]


@on_error(r"device-side assert triggered")
def device_assert(ev: Evidence, m: re.Match[str]) -> list[Finding]:
    return [finding(Cause.DATA, 0.5, None, [_first_line(ev), "a CUDA device-side assert is almost always an index "
                                            "or label out of range; rerun on CPU (--device cpu) for the exact "
                                            "message"], phase=Phase.INPUT)]


@on_error(r"LinAlgError|not positive-definite|singular")
def not_positive_definite(ev: Evidence, m: re.Match[str]) -> list[Finding]:
    f = _failed(ev)
    return [finding(Cause.DOMAIN, 0.7, None, [_first_line(ev), "a matrix factorization (cholesky, inverse, solve) "
                                              "got a matrix that is not positive-definite / invertible: add a "
                                              "small multiple of the identity (jitter) or compute in float64"],
                    phase=f.phase if f else Phase.FORWARD, module=f.module if f else None, op=f.op if f else None)]
