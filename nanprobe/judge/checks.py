"""Per-batch data checks shared by `run` (the diagnosed batch) and `scan-data` (every batch).

A batch is walked into leaves (one per tensor, or one per ragged list of per-sample tensors),
each leaf gets a few vectorized reductions chosen by its role (float features, integer labels,
attention masks, ...), and all of them are read back with a single device sync. Counts, example
values and sample indices are computed only for leaves that have a problem.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..base.batch import key_name

LABEL_KEYS = re.compile(r"(^|_)(label|labels|target|targets|y|tag|tags|class|classes)($|_)", re.I)
MASK_KEYS = re.compile(r"mask", re.I)
LOSS_MASK_KEYS = re.compile(r"(loss|label|labels|target|targets)_?mask", re.I)
PAD_KEYS = re.compile(r"^(pad|pads|padding|is_pad|is_padding|padded)$", re.I)   # a padding mask named without "mask"

# Leaf roles: which reductions a tensor gets and which checks apply to it.
FLOAT = "float"            # floating features: non-finite, beyond range, outliers, constant
FLOAT_MASK = "float_mask"  # additive attention mask (0 / -inf): NaN/+inf, rows all -inf
INT = "int"                # integer features (token ids, ...): constant
LABEL = "label"            # integer targets: negative, >= num_classes, all ignored
MASK = "mask"              # bool/int attention mask (1 = attend): rows that attend to nothing
PAD_MASK = "pad_mask"      # bool/int padding mask (True = padding, key_padding_mask): rows all padding
LOSS_MASK = "loss_mask"    # bool/int mask over the loss: all zero
BOOL = "bool"              # other bool tensors: summary only
OTHER = "other"            # complex, sparse, ...: skipped

WARNING_CODES = ("outlier", "constant", "masked_row_sdpa")   # masked_row_sdpa: a row SDPA here returns 0 for


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
    micro: int | None = None  # the micro-batch of the step (gradient accumulation)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self) | {"samples": list(self.samples)}
        if self.value is not None and not math.isfinite(self.value):
            out["value"] = str(self.value)
        if self.micro is None:
            del out["micro"]
        return out


@functools.cache
def sdpa_masked_row() -> dict[str, dict[str, str]]:
    """What ``scaled_dot_product_attention`` on this torch returns for a query row whose mask attends to
    nothing, measured once per process on CPU for each backend that runs there: {mask kind ("bool",
    "float" -inf row): {backend: "zero" (output and gradient 0) | "nan" | "finite" | "unavailable"}}."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=g) for _ in range(3))
    masks = {"bool": torch.ones(1, 1, 3, 3, dtype=torch.bool), "float": torch.zeros(1, 1, 3, 3)}
    masks["bool"][..., 1, :] = False
    masks["float"][..., 1, :] = -math.inf
    out: dict[str, dict[str, str]] = {}
    for kind, mask in masks.items():
        out[kind] = {}
        for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
            name = backend.name.lower()
            try:
                with sdpa_kernel(backend), torch.enable_grad():
                    qq = q.clone().requires_grad_()
                    o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
                    o.sum().backward()
            except RuntimeError:
                out[kind][name] = "unavailable"
                continue
            row, grad = o[0, 0, 1].detach(), qq.grad[0, 0, 1]
            finite = bool(torch.isfinite(row).all()) and bool(torch.isfinite(grad).all())
            out[kind][name] = "nan" if not finite else "finite" if bool(row.any()) or bool(grad.any()) else "zero"
    return out


def _masked_row_verdict(kind: str) -> tuple[str, str]:
    """(level, what a fully masked row gives) from what SDPA on this torch measured (sdpa_masked_row)."""
    seen = {b: r for b, r in sdpa_masked_row()[kind].items() if r != "unavailable"}
    ver = torch.__version__.split("+")[0]
    if seen and all(r == "zero" for r in seen.values()):
        return "warning", (f"F.scaled_dot_product_attention on this torch ({ver}, cpu: {', '.join(seen)} measured) "
                           "returns 0 for such a row, gradient 0; a hand-written softmax(q k^T + mask) gives 0/0 = NaN")
    bad = [b for b, r in seen.items() if r == "nan"]
    return "error", (f"attention over nothing is 0/0 = NaN (F.scaled_dot_product_attention on this torch ({ver}) "
                     f"gives NaN with the {', '.join(bad)} backend)" if bad else "attention over nothing is 0/0 = NaN")


# -- leaves ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Leaf:
    """One tensor of a batch (or a ragged list of per-sample tensors, concatenated flat)."""

    key: str
    tensor: torch.Tensor
    role: str
    shape: tuple[int, ...]                  # the tensor's shape; ragged: (samples, *largest sample)
    shape_min: tuple[int, ...]              # ragged: (samples, *smallest sample); else == shape
    starts: torch.Tensor | None = None      # ragged: flat offset where each sample starts
    empty_samples: tuple[int, ...] = ()     # ragged: samples with no elements
    fill: int | None = None                 # labels: a valid label seen before (one masked_fill instead of two)
    small: bool = False                     # int features: values small enough for an exact int64 dot
    moments: bool = True                    # also compute sum/sumsq, ignored counts, mask fractions
    ignore_index: int = -100                # labels: set by measure
    buffer: dict | None = None              # labels: scratch tensor reused across batches (owned by the caller)

    @property
    def ragged(self) -> bool:
        return self.starts is not None


@functools.lru_cache(maxsize=4096)
def _role(path: str, dtype: torch.dtype, dim: int, layout: torch.layout) -> str:
    if dtype.is_complex or layout != torch.strided:   # sparse, complex: skipped
        return OTHER
    name = key_name(path)
    if dim >= 2 and not dtype.is_floating_point and PAD_KEYS.search(name):
        return PAD_MASK
    mask, loss_mask = MASK_KEYS.search(name), LOSS_MASK_KEYS.search(name)
    if dtype.is_floating_point:
        return FLOAT_MASK if mask and dim >= 2 and not loss_mask else FLOAT
    if mask:
        if loss_mask:
            return LOSS_MASK
        if dim < 2:
            return BOOL if dtype == torch.bool else INT
        return PAD_MASK if "pad" in name.lower() else MASK
    if dtype == torch.bool:
        return BOOL
    return LABEL if LABEL_KEYS.search(name) else INT


def is_ragged(items: Sequence[Any], top: bool) -> bool:
    if len(items) < 2 or not all(isinstance(v, torch.Tensor) for v in items):
        return False
    first = items[0]
    if first.dim() == 0 or any(v.dtype != first.dtype or v.dim() != first.dim() or v.device != first.device
                               for v in items):
        return False
    # a top-level (x, y) pair is two fields, not two samples
    return any(v.shape != first.shape for v in items) and (len(items) >= 3 or not top)


def _ragged_leaf(path: str, items: Sequence[torch.Tensor]) -> Leaf:
    shapes = [tuple(v.shape) for v in items]
    numels = [v.numel() for v in items]
    flat = torch.cat([v.detach().reshape(-1) for v in items])
    starts = torch.tensor([0] + numels[:-1], device=flat.device).cumsum(0)
    hi, lo = tuple(map(max, zip(*shapes))), tuple(map(min, zip(*shapes)))   # per axis, over the samples
    role = _role(path, items[0].dtype, items[0].dim(), items[0].layout)
    if role in (MASK, PAD_MASK, FLOAT_MASK):   # per-sample masks: a sample's rows are its last axis
        role = FLOAT if role == FLOAT_MASK else INT
    return Leaf(key=path, tensor=flat, role=role, shape=(len(items),) + hi, shape_min=(len(items),) + lo,
                starts=starts, empty_samples=tuple(i for i, n in enumerate(numels) if n == 0))


def leaves(batch: Any) -> list[Leaf]:
    """Every tensor of a nested batch with its key path (as ``batch.iter_tensors`` names them)."""
    out: list[Leaf] = []
    tuple_label = -1
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields") and len(batch) >= 2:
        last = batch[-1]
        if isinstance(last, torch.Tensor) and not last.is_floating_point() and last.dtype != torch.bool \
                and not is_ragged(batch, True):
            tuple_label = len(batch) - 1   # (inputs, targets): the last element holds the labels
    _walk(batch, "batch", out, tuple_label, top=True)
    return out


def _tensor_leaf(path: str, obj: torch.Tensor, role: str | None = None) -> Leaf:
    t = obj.detach() if obj.requires_grad else obj
    return Leaf(key=path, tensor=t, role=role or _role(path, t.dtype, t.dim(), t.layout), shape=t.shape,
                shape_min=t.shape)


def _walk(obj: Any, path: str, out: list[Leaf], tuple_label: int, *, top: bool = False) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(_tensor_leaf(path, obj))
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _walk(value, f"{path}[{key!r}]", out, -1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name), f"{path}.{f.name}", out, -1)
    elif isinstance(obj, (list, tuple)):
        fields_ = getattr(obj, "_fields", None)  # namedtuple
        if not fields_ and is_ragged(obj, top):
            out.append(_ragged_leaf(path, obj))
            return
        for i, value in enumerate(obj):
            sub = f"{path}.{fields_[i]}" if fields_ else f"{path}[{i}]"
            if top and i == tuple_label:
                out.append(_tensor_leaf(sub, value, LABEL))
            else:
                _walk(value, sub, out, -1)


# -- one-sync reductions ---------------------------------------------------------------------------
@dataclass(slots=True)
class Stats:
    """What the reductions of one leaf say, as Python numbers (statistics over finite values).

    ``moments`` batches also carry sum/sumsq, the ignored count of labels and the min/max/sum of
    masks; other batches carry only what the checks need (min/max, mask rows).
    """

    n: int                       # elements
    min: float | None = None
    max: float | None = None
    sum: float | None = None
    sumsq: float | None = None
    finite: bool = True          # float leaves: no NaN/Inf (float masks: no NaN/+inf)
    ignored: int | None = None   # labels: elements equal to ignore_index; loss masks: zeros (None: not counted)
    masked: bool = False         # masks: some row attends to nothing
    nonfinite: int = 0           # set by the detail pass
    moments: bool = False        # sum/sumsq/ignored were computed
    row_low: float | None = None  # float masks: the smallest row maximum (-inf: a row masks out everything)
    negative: bool = False       # labels: a negative label other than the ignore index
    all_ignored: bool = False    # labels: every label is the ignore index
    maybe_all_ignored: bool = False  # labels: all equal to the fill value; the detail pass counts them


def _reductions(leaf: Leaf, ignore_index: int) -> list[torch.Tensor]:
    """0-dim tensors for one leaf; ``_parse`` reads them back in the same order."""
    x = leaf.tensor
    role = leaf.role
    if x.numel() == 0 or role == OTHER:
        return []
    moments = leaf.moments
    if role in (FLOAT, INT):
        mn, mx = torch.aminmax(x)
        if not moments:
            return [mn, mx]
        if role == FLOAT:
            acc = torch.float32 if x.element_size() < 4 else None   # fp16, bf16, fp8: sums in float32
            return [mn, mx, x.sum(dtype=acc), torch.linalg.vector_norm(x, dtype=acc)]
        if leaf.small and x.dtype == torch.int64 and x.is_cpu and x.is_contiguous():
            flat = x.view(-1)   # exact integer sum of squares (the caller knows it cannot overflow)
            return [mn, mx, x.sum(), torch.dot(flat, flat)]
        return [mn, mx, x.sum(), torch.linalg.vector_norm(x.float())]
    if role == LABEL:
        if not moments and ignore_index < 0 and x.dtype == torch.int64:
            # No bool mask (comparisons are the slow ops here): (x - ignore) * x is 0 at the ignore
            # index and at 0, negative exactly for labels strictly between the ignore index and 0.
            mn, mx = torch.aminmax(x)
            key = (x.shape, x.device)
            z = leaf.buffer.get(key) if leaf.buffer is not None else None
            if z is None:
                z = torch.empty_like(x, memory_format=torch.contiguous_format)
                if leaf.buffer is not None:
                    leaf.buffer.clear()
                    leaf.buffer[key] = z
            torch.sub(x, ignore_index, out=z)
            z.mul_(x)
            return [mn, mx, torch.aminmax(z)[0]]   # aminmax: int64 amin() is 3x slower here, and it stays warm
        ignored = x == ignore_index
        if leaf.fill is not None:   # min/max over non-ignored labels plus a valid label seen before
            lo, hi = torch.aminmax(x.masked_fill(ignored, leaf.fill))
            out = [lo, hi]
        else:
            info = torch.iinfo(x.dtype)
            out = [x.masked_fill(ignored, info.max).min(), x.masked_fill(ignored, info.min).amax()]
        if moments:
            out.append(ignored.count_nonzero())
        return out
    if role == FLOAT_MASK:
        lo_row, mx = torch.aminmax(x.amax(-1))   # a row whose max is -inf masks out everything
        return [lo_row, mx]
    if role in (MASK, PAD_MASK, LOSS_MASK, BOOL):
        # MASK: a row whose max is 0 attends to nothing; PAD_MASK: a row whose min is True is all padding
        head = [] if role == BOOL else [x.count_nonzero() if role == LOSS_MASK else
                                        torch.aminmax(x.amax(-1))[0] if role == MASK else torch.aminmax(x.amin(-1))[1]]
        if not moments:
            return head
        # a bool mask: min and max follow from the count of True
        return head + ([x.sum()] if x.dtype == torch.bool and role != LOSS_MASK else [x.sum(), *torch.aminmax(x)])
    return []


def _parse(leaf: Leaf, v: list[float]) -> Stats:
    n = leaf.tensor.numel()
    st = Stats(n=n)
    role = leaf.role
    if not v:
        return st
    if role in (FLOAT, INT):
        st.min, st.max = v[0], v[1]
        if role == FLOAT:
            st.finite = math.isfinite(v[0]) and math.isfinite(v[1])
        if len(v) > 2 and leaf.moments:
            st.moments = True
            st.sum = v[2]
            st.sumsq = v[3] if leaf.small and role == INT else v[3] * v[3]
            if role == INT and leaf.small and max(-v[0], v[1]) ** 2 * n >= 2 ** 62:   # the int64 dot may wrap
                st.sumsq = None
    elif role == LABEL:
        _parse_labels(leaf, v, st)
    elif role == FLOAT_MASK:
        st.max = v[1]
        st.finite = not (math.isnan(v[1]) or v[1] == math.inf)
        st.row_low = v[0]
        st.masked = v[0] == -math.inf
    elif role in (MASK, PAD_MASK, LOSS_MASK, BOOL):
        if role != BOOL:   # the head value: rows that attend to nothing, all padding, the loss mask's count
            head, v = v[0], v[1:]
            if role == LOSS_MASK:
                st.ignored = n - int(head)
            else:
                st.masked = head != 0 if role == PAD_MASK else head == 0
        if v:
            st.moments = True
            # bool: min and max follow from the count of True
            st.sum, st.min, st.max = (v[0], v[1], v[2]) if len(v) > 2 else (v[0], float(v[0] >= n), float(v[0] > 0))
    return st


def _parse_labels(leaf: Leaf, v: list[float], st: Stats) -> None:
    n, lo, hi, ignore = st.n, v[0], v[1], leaf.ignore_index
    fast = not leaf.moments and len(v) == 3   # the mask-free path of _reductions
    # no label that is not ignored
    if (lo == hi == ignore) if fast else (leaf.fill is None and lo >= torch.iinfo(leaf.tensor.dtype).max):
        st.all_ignored = True
        st.ignored = n
        return
    if fast:
        st.negative = lo < ignore or v[2] < 0
        st.min = lo if lo != ignore else None     # unknown when ignored labels hide the smallest
        st.max = hi if hi != ignore else None
        return
    st.min, st.max = lo, hi
    st.negative = lo < 0
    if len(v) > 2:
        st.moments = True
        st.ignored = int(v[2])
        if st.ignored == n:
            st.all_ignored = True
            st.min = st.max = None
    elif leaf.fill is not None and lo == hi == leaf.fill:
        st.maybe_all_ignored = True


def measure_leaves(items: list[Leaf], ignore_index: int,
                   extra: Sequence[torch.Tensor]) -> tuple[list[Stats], list[float]]:
    """Reductions of every leaf (plus ``extra`` 0-dim tensors) read back with one sync per device."""
    for leaf in items:
        leaf.ignore_index = ignore_index
    plans = [_reductions(leaf, ignore_index) for leaf in items]
    parts = [p for plan in plans for p in plan] + list(extra)
    if not parts:
        return [_parse(leaf, []) for leaf in items], []
    devices = {p.device for p in parts}
    if len(devices) == 1:
        values = _read(parts)
    else:  # rare: tensors of one batch on several devices; one sync each
        values = [0.0] * len(parts)
        for device in devices:
            idx = [i for i, p in enumerate(parts) if p.device == device]
            for i, value in zip(idx, _read([parts[i] for i in idx])):
                values[i] = value
    stats, pos = [], 0
    for leaf, plan in zip(items, plans):
        stats.append(_parse(leaf, values[pos:pos + len(plan)]))
        pos += len(plan)
    return stats, values[pos:]


@functools.cache
def _zero64(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64, device=device)


def _read(parts: list[torch.Tensor]) -> list[float]:
    device = parts[0].device
    if device.type == "cpu":   # no device to wait for: reading each value is cheaper than a stack
        return [p.item() for p in parts]
    if device.type == "mps":
        return torch.stack([p.float() for p in parts]).tolist()
    return torch.stack([*parts, _zero64(device)]).tolist()[:-1]   # the float64 zero makes the stack float64


# -- problems --------------------------------------------------------------------------------------
def sample_rows(leaf: Leaf, bad: torch.Tensor, limit: int) -> tuple[int, ...]:
    """The first ``limit`` samples (dim 0, or ragged list index) where ``bad`` is true."""
    if bad.dim() == 0 or limit <= 0:
        return ()
    if leaf.ragged:
        pos = bad.reshape(-1).nonzero().flatten()
        rows = torch.searchsorted(leaf.starts, pos, right=True) - 1
        return tuple(int(i) for i in torch.unique_consecutive(rows)[:limit].tolist())
    rows = bad.reshape(bad.shape[0], -1).any(1) if bad.dim() > 1 else bad
    return tuple(int(i) for i in rows.nonzero().flatten()[:limit].tolist())


def empty_problem(leaf: Leaf, step: int | None, max_examples: int) -> DataProblem | None:
    key, shape, empty = leaf.key, leaf.shape, leaf.empty_samples

    def problem(count: int, samples: tuple[int, ...], what: str) -> DataProblem:
        return DataProblem(code="empty", level="error", step=step, key=key, count=count, samples=samples, value=None,
                           message=f"{key} {what} is 0/0 = NaN")
    if leaf.ragged:
        return problem(len(empty), empty[:max_examples], f"holds {len(empty)} empty sequence(s) (sample {empty[0]} "
                       "has no elements): a mean over it") if empty else None
    if leaf.tensor.numel() == 0 and (len(shape) < 2 or shape[0] == 0):
        return problem(0, (), f"is empty (shape {shape}): a mean over it")
    if len(shape) >= 2 and 0 in shape[1:]:
        return problem(shape[0], tuple(range(min(shape[0], max_examples))),
                       f"has zero-length sequences (shape {shape}): a mean over them")
    return None


def suspect(leaf: Leaf, st: Stats, num_classes: int | None, range_max: float | None) -> bool:
    """Whether the reductions point at a problem (cheap, Python numbers only); ``leaf_problems`` confirms."""
    role, shape = leaf.role, leaf.shape
    if leaf.empty_samples or st.n == 0 or (len(shape) >= 2 and 0 in shape[1:]):
        return True
    if role == FLOAT:
        return (not st.finite or (st.moments and not (math.isfinite(st.sum) and math.isfinite(st.sumsq)))
                or (range_max is not None and max(-st.min, st.max) > range_max))
    if role == LABEL:
        return (st.all_ignored or st.maybe_all_ignored or st.negative
                or (num_classes is not None and st.max is not None and st.max >= num_classes))
    if role in (MASK, PAD_MASK):
        return st.masked
    if role == INT:
        return st.moments and st.sumsq is None
    if role == FLOAT_MASK:   # in low precision, a row below -max becomes all -inf on the cast
        return not st.finite or st.masked or (range_max is not None and st.row_low < -range_max)
    if role == LOSS_MASK:
        return st.ignored == st.n
    return False


def leaf_problems(leaf: Leaf, st: Stats, *, step: int | None, ignore_index: int, num_classes: int | None,
                  range_max: float | None, max_examples: int) -> list[DataProblem]:
    """Error-level problems of one leaf; the detail pass (counts, samples) runs only when one is found.

    For a float leaf with non-finite values the statistics in ``st`` are recomputed over its
    finite values, so summaries stay meaningful.
    """
    empty = empty_problem(leaf, step, max_examples)
    out: list[DataProblem] = [] if empty is None else [empty]
    x, key, role = leaf.tensor, leaf.key, leaf.role
    if x.numel() == 0:
        return out

    def add(code: str, bad: torch.Tensor, message, level: str = "error") -> None:
        c, example = int(bad.sum()), None
        if not code.startswith("masked_row"):
            example = float(x[bad].flatten()[0]) if x.dim() else float(x)
        out.append(DataProblem(code=code, level=level, step=step, key=key, count=c,
                               samples=sample_rows(leaf, bad, max_examples), value=example,
                               message=message(c, example)))

    def all_ignored(value: float, message: str) -> DataProblem:
        return DataProblem(code="all_ignored", level="error", step=step, key=key, count=st.n, samples=(), value=value,
                           message=message)

    def masked_rows(rows: torch.Tensor, where: str, verdict: tuple[str, str]) -> None:
        level, what = verdict
        add("masked_row" if level == "error" else "masked_row_sdpa", rows,
            lambda c, e: f"{key} masks out every position of {c} row(s){where}: {what}", level=level)

    if role == FLOAT:
        if not st.finite:
            finite = torch.isfinite(x)
            add("nonfinite", ~finite, lambda c, e: f"{key} holds {c} non-finite value(s) ({e})")
            _finite_stats(x[finite], st)
        elif st.moments and not (math.isfinite(st.sum) and math.isfinite(st.sumsq)):
            _finite_stats(x, st)   # the float32 sums overflowed; the values are finite
        if range_max is not None and st.min is not None and max(-st.min, st.max) > range_max:
            bad = torch.isfinite(x) & (x.abs() > range_max)
            add("beyond_range", bad, lambda c, e: f"{key} holds {c} value(s) beyond ±{range_max:g} (e.g. {e:g}): "
                                                   "they become inf when cast to the training precision")
    elif role == INT:
        if st.moments and st.sumsq is None:
            st.sumsq = float(torch.linalg.vector_norm(x.double())) ** 2
    elif role == FLOAT_MASK:
        if not st.finite:
            add("nonfinite", torch.isnan(x) | (x == math.inf),
                lambda c, e: f"{key} holds {c} NaN/+inf value(s) ({e}); an additive mask holds 0 and -inf only")
        if st.masked:
            masked_rows(x.amax(-1) == -math.inf, " (all -inf)", _masked_row_verdict("float"))
        elif range_max is not None and st.row_low < -range_max:
            masked_rows(x.amax(-1) < -range_max,
                        f" (all below -{range_max:g}: -inf once cast to the training precision)",
                        ("error", "attention over nothing is 0/0 = NaN"))
    elif role == LABEL:
        if st.maybe_all_ignored:
            st.ignored = int((x == ignore_index).count_nonzero())
            if st.ignored == st.n:
                st.all_ignored = True
                st.min = st.max = None
        if st.all_ignored:
            return out + [all_ignored(float(ignore_index), f"every label in {key} is the ignore index {ignore_index}: "
                                      "a mean cross-entropy over no labels is 0/0 = NaN")]
        if st.negative:
            neg = (x < 0) & (x != ignore_index)
            # one repeated value: most likely the loss's own ignore index (minGPT, nanoGPT: -1)
            single = bool(neg.any()) and x[neg].unique().numel() == 1
            hint = '; if your loss ignores {0:g}, say so: "ignore_index": {0:g} in the target' if single else ""
            add("label_negative", neg, lambda c, e: f"{key} holds {c} negative label(s) (e.g. {e:g}) other than the "
                                                    f"ignore index {ignore_index}" + hint.format(e))
        if num_classes is not None and st.max is not None and st.max >= num_classes:
            add("label_out_of_range", (x >= num_classes) & (x != ignore_index),
                lambda c, e: f"{key} holds {c} label(s) >= num_classes {num_classes} (e.g. {e:g})")
    elif role in (MASK, PAD_MASK):
        if st.masked:
            m = x.bool()
            masked_rows(m.all(-1) if role == PAD_MASK else ~m.any(-1), "", _masked_row_verdict("bool"))
    elif role == LOSS_MASK:
        if st.ignored == st.n:
            out.append(all_ignored(0.0, f"{key} is zero everywhere: a loss averaged over the masked positions is "
                                        "0/0 = NaN"))
    return out


def _finite_stats(v: torch.Tensor, st: Stats) -> None:
    """Recompute ``st`` in float64 over ``v`` (the finite values of the leaf)."""
    st.nonfinite = st.n - v.numel()
    st.n = v.numel()
    if v.numel() == 0:
        st.min = st.max = st.sum = st.sumsq = None
        return
    d = v.double()
    mn, mx = torch.aminmax(d)
    st.min, st.max, st.sum, st.sumsq = torch.stack([mn, mx, d.sum(), (d * d).sum()]).tolist()
    st.moments = True


def check_batch(batch: Any, *, step: int | None = None, ignore_index: int = -100, num_classes: int | None = None,
                range_max: float | None = None, max_examples: int = 5) -> list[DataProblem]:
    """Problems in one batch that turn into NaN/Inf in training.

    ``range_max`` is the largest finite value of the training precision (65504 for fp16):
    floating values beyond it become inf on the autocast cast.
    """
    items = leaves(batch)
    stats, _ = measure_leaves(items, ignore_index, ())
    problems: list[DataProblem] = []
    for leaf, st in zip(items, stats):
        if suspect(leaf, st, num_classes, range_max):
            problems += leaf_problems(leaf, st, step=step, ignore_index=ignore_index, num_classes=num_classes,
                                  range_max=range_max, max_examples=max_examples)
    return problems
