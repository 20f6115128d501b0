"""Does a step's batch stand out against the batches before it? Positive evidence for a ``data`` finding.

Per key (the paths ``checks.leaves`` names), each batch gets a few statistics: for float features
the root mean square and the largest |x|; for labels their histogram; for masks and ragged
sequences the lengths. The step's batch stands out when a statistic leaves the range the batches
before it spanned by more than ``factor`` (float features: 1000x too large or too small is a
change of units; lengths: ``factor`` too; labels: a histogram that shares less than ``1/factor``
with the pooled histogram before). Each problem names the key and the samples that carry it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from .checks import FLOAT, LABEL, LOSS_MASK, MASK, PAD_MASK, DataProblem, Leaf, leaves, sample_rows

_LENGTH_ROLES = (MASK, PAD_MASK, LOSS_MASK)


@dataclass(slots=True)
class _KeyStats:
    rms: float | None = None
    absmax: float | None = None
    length: float | None = None              # mean valid length per sample
    labels: Counter = field(default_factory=Counter)


def _stats(leaf: Leaf, ignore_index: int) -> _KeyStats | None:
    t = leaf.tensor
    if t.numel() == 0:
        return None
    if leaf.role == FLOAT:
        x = t.detach().float()
        x = x[torch.isfinite(x)]
        if x.numel() == 0:
            return None
        return _KeyStats(rms=float(x.square().mean().sqrt()), absmax=float(x.abs().max()))
    if leaf.role == LABEL and not leaf.ragged:
        v = t.detach().reshape(-1)
        v = v[v != ignore_index]
        return _KeyStats(labels=Counter(v.tolist()) if v.numel() <= 1 << 16 else Counter())
    if leaf.role in _LENGTH_ROLES and t.dim() >= 2 and not leaf.ragged:
        valid = t.detach().reshape(t.shape[0], -1)
        valid = ~valid.bool() if leaf.role == PAD_MASK else valid.bool()
        return _KeyStats(length=float(valid.sum(1).float().mean()))
    if leaf.ragged:
        ends = torch.cat([leaf.starts[1:], leaf.starts.new_tensor([t.numel()])])
        return _KeyStats(length=float((ends - leaf.starts).float().mean()))
    return None


def _tv(a: Counter, b: Counter) -> float:
    """Total variation distance between two label histograms (0: the same shares, 1: disjoint)."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return 0.0
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def batch_shift(items: list[Any], before: list[list[Any]], *, step: int, factor: float = 10.0,
                min_batches: int = 3, ignore_index: int = -100, max_examples: int = 5) -> list[DataProblem]:
    """Keys of the step's batch (each micro-batch in ``items``) whose statistics stand out against every
    batch in ``before`` (each a list of micro-batches), as warning-level ``shift`` problems."""
    history: dict[str, list[_KeyStats]] = {}
    for leaf in (leaf for batch in before for item in batch for leaf in leaves(item)):
        st = _stats(leaf, ignore_index)
        if st is not None:
            history.setdefault(leaf.key, []).append(st)
    out: list[DataProblem] = []
    for j, item in enumerate(items):
        for leaf in leaves(item):
            seen = history.get(leaf.key, [])
            st = _stats(leaf, ignore_index)
            if st is None or len(seen) < min_batches:
                continue
            p = _judge(leaf, st, seen, step=step, factor=factor, max_examples=max_examples)
            if p is not None:
                out.append(p if len(items) == 1 else
                           dataclasses.replace(p, micro=j, message=f"micro-batch {j}: {p.message}"))
    return out


def _judge(leaf: Leaf, st: _KeyStats, seen: list[_KeyStats], *, step: int, factor: float,
           max_examples: int) -> DataProblem | None:
    n = len(seen)

    def shift(count: int, samples: tuple[int, ...], value: float | None, message: str) -> DataProblem:
        return DataProblem(code="shift", level="warning", step=step, key=leaf.key, count=count, samples=samples,
                           value=value, message=message)
    if st.rms is not None:
        rms = [s.rms for s in seen if s.rms is not None]
        tops = [s.absmax for s in seen if s.absmax is not None]
        if not rms or not tops:
            return None
        lo, hi, top = min(rms), max(rms), max(tops)
        if (st.rms > factor * hi and hi > 0) or (st.absmax > factor * top and top > 0):
            x = leaf.tensor.detach().float()
            hit = torch.isfinite(x) & (x.abs() > top)
            mid = sorted(rms)[len(rms) // 2]
            ratio = st.rms / mid if mid > 0 else float("inf")
            return shift(int(hit.sum()), () if leaf.ragged else sample_rows(leaf, hit, max_examples), st.absmax,
                         (f"{leaf.key} is {ratio:.3g}x its usual size in this batch" if st.rms > factor * hi
                          else f"{leaf.key} holds values {st.absmax / top:.3g}x beyond its usual range")
                         + f" (rms {st.rms:.3g}, |x| up to {st.absmax:.3g}; the {n} batches before: rms "
                           f"{lo:.3g}..{hi:.3g}, |x| up to {top:.3g})")
        if lo > 0 and st.rms * factor < lo:
            # a key with no spread in this batch (one sample normalised by its own mean, all zeros) has rms 0
            smaller = f"{lo / st.rms:.3g}x smaller than" if st.rms > 0 else "all zeros, unlike"
            return shift(leaf.tensor.numel(), tuple(range(min(max_examples, leaf.shape[0] if leaf.shape else 0))),
                         st.rms, f"{leaf.key} is {smaller} any of the {n} batches before (rms {st.rms:.3g} vs "
                                 f"{lo:.3g}..{hi:.3g})")
        return None
    if st.length is not None:
        lengths = [s.length for s in seen if s.length is not None]
        if not lengths:
            return None
        lo, hi = min(lengths), max(lengths)
        if st.length > factor * hi or (lo > 0 and st.length * factor < lo):
            return shift(leaf.shape[0], (), st.length, f"{leaf.key}: the mean length per sample is {st.length:.3g} "
                                                       f"in this batch, {lo:.3g}..{hi:.3g} in the {n} batches before")
        return None
    if st.labels:
        pooled = sum((s.labels for s in seen), Counter())
        dist = _tv(st.labels, pooled)
        usual = max((_tv(s.labels, pooled) for s in seen if s.labels), default=0.0)
        if dist > 1 - 1 / factor and dist > 2 * usual:
            new = sorted(k for k in st.labels if k not in pooled)
            x = leaf.tensor.detach()
            hit = torch.isin(x, torch.tensor(new, dtype=x.dtype, device=x.device)) if new else \
                torch.zeros_like(x, dtype=torch.bool)
            what = f"labels never seen before ({', '.join(map(str, new[:5]))})" if new else "other label shares"
            return shift(int(hit.sum()), sample_rows(leaf, hit, max_examples), float(new[0]) if new else None,
                         f"{leaf.key} holds {what}: its label histogram differs from the {n} batches before by "
                         f"{dist:.2f} (total variation; those batches differ by at most {usual:.2f})")
    return None


__all__ = ["batch_shift"]
