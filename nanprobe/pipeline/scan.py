"""`nanprobe scan-data` as a library call: iterate the target's batches (no training, no optimizer)
and report every problem with its step, key path and sample indices, plus a per-key summary.

Per batch: the checks of ``checks.py`` (non-finite, empty, beyond the precision's range, bad or
all-ignored labels, fully masked rows) and two checks against running per-key statistics:

* outliers: a robust z-score ``|x - median| / (1.4826 * MAD)`` of the batch's extreme values,
  with median and MAD estimated on a random subsample of the key's batches. A batch is flagged
  when its z-score exceeds ``scan.zscore`` and also ``scan.typical_factor`` times the key's
  typical (median) batch z-score, so multi-scale or heavy-tailed keys do not warn on every
  batch. The first ``scan.warmup_batches`` batches of a key are judged once that typical value
  is known.
* constant tensors: a key whose values vary in some batches but are all equal in another.

Cost: every batch gets only the reductions its checks need (one or a few per tensor), read back
with one device sync; mean/std and ignored/mask fractions come from every
``scan.moments_every``-th batch of a key; details (counts, samples) are computed only for batches
with a problem. Measured on CPU, an op that runs rarely costs ~10x an op that runs every batch
(cold caches after the data loader's work), so rare work is kept rare: see ``_refresh_due``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.version import __version__
from ..base.batch import clone_batch, iter_tensors, key_name, map_tensors
from ..judge.checks import (BOOL, FLOAT, FLOAT_MASK, INT, LABEL, LOSS_MASK, MASK, PAD_MASK, WARNING_CODES, DataProblem, Leaf,
                     Stats, measure_leaves, is_ragged, leaf_problems, leaves, sample_rows, suspect)
from ..base.config import Config, ScanConfig, load_config
from ..reach.entry import Loaded, load_target
from ..base.errors import EXIT_FOUND, EXIT_OK, UsageError
from ..base.precision import Precision, describe_device, device_of, limits, parse_precision
from ..reach.feed import DataEnd, Stream, epoch_length, is_callable_batches
from ..base.report import SCHEMA, Status, _num
from ..reach.state import borrows_globals, capture_rng, set_rng
from ..reach.target import Target

_POOL_CHUNK = 256     # subsampled values a contributing batch adds to a key's reference pool
_POOL_CHUNKS = 16     # chunks kept per key (the pool holds at most 4096 values)
_REFRESH = 128        # batches 0, 2, 8, 32, then every 128th batch of a key refresh its median/MAD
                      # (rarely run ops cost ~10x their warm time, measured: keep them rare)
_Z_HISTORY = 256      # batch z-scores kept per key for its typical z-score


def _refresh_due(batches: int) -> bool:
    return batches % _REFRESH == 0 or batches in (2, 8, 32)


@dataclass(frozen=True, slots=True, kw_only=True)
class KeySummary:
    """Everything seen under one batch key path over the scan."""

    key: str
    role: str                      # float | float_mask | int | label | mask | loss_mask | bool | other
    dtypes: tuple[str, ...]
    batches: int                   # batches that held this key
    shape_min: tuple[int, ...]     # per dimension over batches (ragged lists: over samples)
    shape_max: tuple[int, ...]
    ragged: bool
    elements: int
    min: float | None              # over finite values (labels: over non-ignored values)
    max: float | None
    mean: float | None             # mean, std and ignored_fraction: over the moment batches (see below)
    std: float | None
    nonfinite: int                 # non-finite elements
    ignored_fraction: float | None  # labels: share equal to ignore_index; loss masks: share of zeros
    moment_batches: int            # batches that fed mean/std/ignored_fraction (every scan.moments_every-th)
    problems: dict[str, int]       # code -> batches with that problem

    def to_json(self) -> dict[str, Any]:
        integral = self.role not in (FLOAT, FLOAT_MASK)

        def num(x):
            return int(x) if integral and x is not None and math.isfinite(x) and x == int(x) else _num(x)

        return {"role": self.role, "dtype": ", ".join(self.dtypes), "shape_min": list(self.shape_min),
                "shape_max": list(self.shape_max), "ragged": self.ragged, "batches": self.batches,
                "elements": self.elements, "min": num(self.min), "max": num(self.max), "mean": _num(self.mean),
                "std": _num(self.std), "nonfinite": self.nonfinite, "ignored_fraction": _num(self.ignored_fraction),
                "moment_batches": self.moment_batches, "problems": dict(self.problems)}


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanResult:
    entry: str
    device: str
    precision: str
    batches_scanned: int
    complete: bool                        # the data ran out (False: stopped at --limit)
    problems: tuple[DataProblem, ...]     # by step, errors first; at most scan.max_problems
    problems_total: int
    summary: tuple[KeySummary, ...]       # keys in order of first appearance
    num_classes: int | None
    num_classes_source: str | None        # "--num-classes" | "target" | "model output width"
    ignore_index: int
    range_max: float | None               # largest finite value of the precision (fp16: 65504)
    notes: tuple[str, ...] = ()

    @property
    def errors(self) -> int:
        return sum(n for s in self.summary for c, n in s.problems.items() if c not in WARNING_CODES)

    @property
    def warnings(self) -> int:
        return sum(n for s in self.summary for c, n in s.problems.items() if c in WARNING_CODES)

    @property
    def status(self) -> Status:
        return Status.NONFINITE if self.errors else Status.FINITE

    @property
    def exit_code(self) -> int:
        return EXIT_FOUND if self.errors else EXIT_OK

    @property
    def first_error_step(self) -> int | None:
        return min((p.step for p in self.problems if p.level == "error" and p.step is not None), default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "nanprobe": __version__, "command": "scan-data", "entry": self.entry,
            "step": self.first_error_step, "status": self.status.value, "device": self.device,
            "precision": self.precision, "batches_scanned": self.batches_scanned, "complete": self.complete,
            "num_classes": self.num_classes, "num_classes_source": self.num_classes_source,
            "ignore_index": self.ignore_index, "range_max": self.range_max,
            "errors": self.errors, "warnings": self.warnings, "problems_total": self.problems_total,
            "problems": [p.to_json() for p in self.problems],
            "summary": {s.key: s.to_json() for s in self.summary},
            "notes": list(self.notes),
        }


@dataclass(slots=True)
class _Candidate:
    step: int
    leaf: Leaf
    stats: Stats
    median: float
    scale: float
    z: float


@dataclass(slots=True)
class _Key:
    key: str
    role: str
    dtypes: list[str] = field(default_factory=list)
    batches: int = 0
    shape_min: list[int] | None = None
    shape_max: list[int] | None = None
    ragged: bool = False
    last_shape: tuple | None = None
    last_dtype: torch.dtype | None = None
    elements: int = 0
    n: int = 0                           # elements of the moment batches (finite ones)
    sum: float = 0.0
    sumsq: float = 0.0
    moment_batches: int = 0
    counted: int = 0                     # elements whose ignored status was counted
    ignored: int = 0
    min: float | None = None
    max: float | None = None
    nonfinite: int = 0
    problems: Counter = field(default_factory=Counter)
    # outliers
    pool: deque = field(default_factory=lambda: deque(maxlen=_POOL_CHUNKS))
    median: float | None = None
    scale: float | None = None
    zs: deque = field(default_factory=lambda: deque(maxlen=_Z_HISTORY))
    judged: int = 0                      # batches with a z-score
    candidates: list[_Candidate] = field(default_factory=list)
    fill: int | None = None              # labels: a valid label seen (see Leaf.fill)
    buffer: dict = field(default_factory=dict)   # labels: scratch tensors reused across batches
    # constant
    varied: bool = False
    constant_steps: list[tuple[int, float, int]] = field(default_factory=list)

    def summary(self) -> KeySummary:
        mean = std = None
        if self.n and self.role in (FLOAT, INT, MASK, PAD_MASK, LOSS_MASK, BOOL):
            mean = self.sum / self.n
            if self.role in (FLOAT, INT):
                std = math.sqrt(max(self.sumsq / self.n - mean * mean, 0.0))
            elif self.min is not None and self.min >= 0 and self.max <= 1:  # 0/1 masks
                std = math.sqrt(max(mean * (1 - mean), 0.0))
        return KeySummary(key=self.key, role=self.role, dtypes=tuple(self.dtypes), batches=self.batches,
                          shape_min=tuple(self.shape_min or ()), shape_max=tuple(self.shape_max or ()),
                          ragged=self.ragged, elements=self.elements, min=self.min, max=self.max, mean=mean,
                          std=std, nonfinite=self.nonfinite,
                          ignored_fraction=self.ignored / self.counted if self.counted else None,
                          moment_batches=self.moment_batches, problems=dict(self.problems))


class Scanner:
    """Running per-key state over a stream of batches; ``add`` checks one batch."""

    def __init__(self, cfg: ScanConfig, *, ignore_index: int = -100, num_classes: int | None = None,
                 range_max: float | None = None):
        self.cfg = cfg
        self.ignore_index = ignore_index
        self.num_classes = num_classes
        self.range_max = range_max
        self.moments_every = max(1, cfg.moments_every)   # 0 and 1: every batch
        self.keys: dict[str, _Key] = {}
        self.problems: list[DataProblem] = []
        self.total = 0
        self.batches = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    # -- per batch --------------------------------------------------------------------------------
    def add(self, step: int, batch: Any) -> None:
        items = leaves(batch)
        extra: list[torch.Tensor] = []
        refresh: list[tuple[_Key, int]] = []
        states = []
        for leaf in items:
            ks = self.keys.get(leaf.key)
            if ks is None:
                ks = self.keys[leaf.key] = _Key(key=leaf.key, role=leaf.role)
            states.append(ks)
            leaf.moments = ks.batches % self.moments_every == 0
            if leaf.role == LABEL:
                leaf.fill = ks.fill
                leaf.buffer = ks.buffer
            elif leaf.role == INT:   # int64 sum of squares cannot overflow (x2 headroom on the values seen)
                bound = max(abs(ks.min), abs(ks.max)) if ks.min is not None else None
                leaf.small = bound is not None and (2 * bound + 1) ** 2 * leaf.tensor.numel() < 2 ** 62
            elif leaf.role == FLOAT and leaf.tensor.numel() > 1 and _refresh_due(ks.batches):
                refresh.append((ks, len(extra)))
                extra += self._reference(ks, leaf.tensor)
        stats, values = measure_leaves(items, self.ignore_index, extra)
        for ks, i in refresh:
            median, mad, meanad = values[i:i + 3]
            ks.median = median if math.isfinite(median) else None
            scale = 1.4826 * mad if mad > 0 else 1.2533 * meanad   # MAD = 0: mean absolute deviation
            ks.scale = scale if math.isfinite(scale) and scale > 0 else None
        num_classes, range_max = self.num_classes, self.range_max
        for leaf, st, ks in zip(items, stats, states):
            found = ()
            if suspect(leaf, st, num_classes, range_max):
                found = leaf_problems(leaf, st, step=step, ignore_index=self.ignore_index, num_classes=num_classes,
                                      range_max=range_max, max_examples=self.cfg.max_examples)
                for p in found:
                    self._record(ks, p)
            self._update(ks, leaf, st)
            role = leaf.role
            if st.min is None:
                continue
            if role in (FLOAT, INT) and st.n > 1:
                self._constant(ks, step, st)
            if role == FLOAT and not found:   # an error already explains an extreme value
                self._outlier(ks, step, leaf, st)
            elif role == LABEL and ks.fill is None and not found:
                ks.fill = next((int(v) for v in (st.min, st.max) if v is not None and v >= 0
                                and (num_classes is None or v < num_classes)), None)
        self.batches += 1

    def _reference(self, ks: _Key, x: torch.Tensor) -> list[torch.Tensor]:
        """Add a random subsample of ``x`` to the key's pool; median, MAD and mean |dev| as 0-dim tensors."""
        flat = x.reshape(-1)
        dtype = torch.float64 if x.dtype == torch.float64 and x.device.type != "mps" else torch.float32
        if flat.numel() > _POOL_CHUNK:
            gen = self._generators.get(x.device)
            if gen is None:
                gen = self._generators[x.device] = torch.Generator(device=x.device).manual_seed(0)
            idx = torch.randint(flat.numel(), (_POOL_CHUNK,), generator=gen, device=x.device)
            sub = flat[idx].to(dtype)
        else:
            sub = flat.to(dtype, copy=True)
        sub = torch.add(sub - sub, sub)   # x - x + x is x for finite x and NaN for NaN/inf (nanmedian skips them)
        ks.pool.append(sub)
        pool = torch.cat(list(ks.pool)) if len(ks.pool) > 1 else sub
        median = pool.nanmedian()
        dev = (pool - median).abs()
        return [median, dev.nanmedian(), dev.nanmean()]

    def _update(self, ks: _Key, leaf: Leaf, st: Stats) -> None:
        ks.batches += 1
        dtype = leaf.tensor.dtype
        if dtype is not ks.last_dtype:
            ks.last_dtype = dtype
            name = str(dtype).removeprefix("torch.")
            if name not in ks.dtypes:
                ks.dtypes.append(name)
        if leaf.shape == ks.last_shape and not leaf.ragged:
            pass
        elif ks.shape_min is None:
            ks.shape_min, ks.shape_max = list(leaf.shape_min), list(leaf.shape)
        elif len(ks.shape_min) == len(leaf.shape):
            ks.shape_min = [min(a, b) for a, b in zip(ks.shape_min, leaf.shape_min)]
            ks.shape_max = [max(a, b) for a, b in zip(ks.shape_max, leaf.shape)]
        elif len(leaf.shape) > len(ks.shape_max):   # rank changed: keep the larger rank as max
            ks.shape_max = list(leaf.shape)
        ks.last_shape = leaf.shape
        ks.ragged = ks.ragged or leaf.ragged
        ks.elements += st.n + st.nonfinite
        ks.nonfinite += st.nonfinite
        if st.ignored is not None and st.moments:   # a fraction over the moment batches only (unbiased)
            ks.ignored += st.ignored
            ks.counted += st.n
        if st.min is not None:
            ks.min = st.min if ks.min is None else min(ks.min, st.min)
        if st.max is not None and not math.isnan(st.max):
            ks.max = st.max if ks.max is None else max(ks.max, st.max)
        if st.moments:
            ks.moment_batches += 1
            if st.sum is not None and st.n:
                ks.n += st.n
                ks.sum += st.sum
                ks.sumsq += st.sumsq or 0.0

    def _record(self, ks: _Key, p: DataProblem) -> None:
        ks.problems[p.code] += 1
        self.total += 1
        if len(self.problems) < self.cfg.max_problems:
            self.problems.append(p)

    # -- checks against running statistics ---------------------------------------------------------
    def _constant(self, ks: _Key, step: int, st: Stats) -> None:
        if st.min == st.max:
            ks.constant_steps.append((step, st.min, st.n))
        else:
            ks.varied = True
        if ks.varied:   # reported once the key is seen to vary (batches before that wait)
            for s, value, n in ks.constant_steps:
                self._record(ks, DataProblem(code="constant", level="warning", step=s, key=ks.key, count=n,
                                             samples=(), value=value, message=f"{ks.key} is constant ({value:g} in "
                                             f"all {n} values) while it varies in other batches"))
            ks.constant_steps.clear()

    def _outlier(self, ks: _Key, step: int, leaf: Leaf, st: Stats) -> None:
        if ks.median is None or ks.scale is None:
            return
        z = max(st.max - ks.median, ks.median - st.min) / ks.scale
        if not math.isfinite(z):
            return
        ks.zs.append(z)
        ks.judged += 1
        if z > self.cfg.zscore:
            ks.candidates.append(_Candidate(step=step, leaf=leaf, stats=st, median=ks.median, scale=ks.scale, z=z))
        if ks.judged >= self.cfg.warmup_batches:   # judged once the key's typical z-score is known
            self._judge(ks)

    def _judge(self, ks: _Key) -> None:
        limit = max(self.cfg.zscore, self.cfg.typical_factor * statistics.median(ks.zs)) if ks.candidates else math.inf
        for c in ks.candidates:
            if c.z > limit:
                self._record(ks, self._outlier_problem(ks, c, limit))
        ks.candidates = []

    def _outlier_problem(self, ks: _Key, c: _Candidate, limit: float) -> DataProblem:
        x, st, median = c.leaf.tensor, c.stats, c.median
        bad = torch.isfinite(x) & ((x - median).abs() > limit * c.scale)
        count = int(bad.sum())
        value = st.max if st.max - median >= median - st.min else st.min
        return DataProblem(code="outlier", level="warning", step=c.step, key=ks.key, count=count,
                           samples=sample_rows(c.leaf, bad, self.cfg.max_examples), value=value,
                           message=f"{ks.key} holds {count} extreme value(s) (e.g. {value:g}, robust z-score "
                                   f"{c.z:.0f} vs median {median:.4g}, scale {c.scale:.3g}; limit {limit:.3g})")

    def drop_num_classes(self) -> str | None:
        """Drop an inferred ``num_classes`` that most labels of the first batch exceed, with the problems it
        raised: it is not the number of classes (e.g. the model returns hidden states and loss_fn applies the
        head). Returns the note that says so (None: kept)."""
        dropped = [p for p in self.problems if p.step == 0 and p.code == "label_out_of_range"]
        bad = sum(p.count for p in dropped)
        labelled = sum(ks.counted - ks.ignored for ks in self.keys.values() if ks.role == LABEL)
        if not bad or bad <= 0.01 * max(labelled, 1):
            return None
        for p in dropped:
            counts = self.keys[p.key].problems
            counts[p.code] -= 1
            if not counts[p.code]:
                del counts[p.code]
        self.problems = [p for p in self.problems if p not in dropped]
        self.total -= len(dropped)
        width, self.num_classes = self.num_classes, None
        return (f"the model's output width {width} is below {bad} of {labelled} labels in the first batch, so "
                "it is not the number of classes; pass --num-classes to check label range")

    def finish(self) -> None:
        for ks in self.keys.values():
            if ks.candidates:
                self._judge(ks)
        self.problems.sort(key=lambda p: (p.step if p.step is not None else -1, p.level != "error"))


# -- num_classes from the model -------------------------------------------------------------------
class _Stop(BaseException):
    """Raised from the model's forward hook: the loss is never computed (no CUDA asserts on bad labels)."""


def infer_num_classes(target: Target, batch: Any) -> int | None:
    """The model's output width from one forward pass on ``batch`` (eval mode, no grad), or None.

    The forward hook stops ``loss_fn`` right after the model's forward, so the loss (which
    could hit a device-side assert on a bad label) never runs. Train/eval flags and RNG states are
    restored; any failure means "unknown".
    """
    model = target.model
    modes = [(m, m.training) for m in model.modules()]
    captured: list[Any] = []

    def hook(module, args, output):
        captured.append(output)
        raise _Stop

    rng = capture_rng("cuda" if torch.cuda.is_initialized() else "cpu", host=False)   # (CUDA: only if in use)
    handle = model.register_forward_hook(hook)
    try:
        model.eval()
        with torch.no_grad():
            target.loss_fn(model, first_sample(batch))
    except _Stop:
        pass
    except Exception:  # noqa: BLE001 - inference is best effort; the scan goes on without it
        return None
    finally:
        handle.remove()
        model.train(modes[0][1])
        for m, mode in modes:
            m.training = mode
        set_rng(rng)
    if not captured:
        return None
    outs = list(iter_tensors(captured[0], "output"))
    named = [t for k, t in outs if "logit" in key_name(k).lower()]
    return next((int(t.shape[-1]) for t in named + [t for _, t in outs]
                 if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] >= 2), None)


def first_sample(batch: Any) -> Any:
    """A copy of ``batch`` cut to its first sample: tensors whose dim 0 is the batch size keep
    one row, ragged lists keep their first element, everything else is kept (cloned)."""
    sizes = Counter(t.shape[0] for _, t in iter_tensors(batch) if t.dim() >= 1)
    if not sizes:
        return clone_batch(batch)
    size = sizes.most_common(1)[0][0]
    return map_tensors(batch, lambda t: t[:1].clone() if t.dim() >= 1 and t.shape[0] == size else t.clone(),
                       ragged=lambda items, top: type(items)(v.clone() for v in items[:1])
                       if is_ragged(items, top) else None)


# -- the library call -----------------------------------------------------------------------------
def _loaded(entry_or_loaded: str | Loaded | Target) -> Loaded:
    if isinstance(entry_or_loaded, Loaded):
        return entry_or_loaded
    if isinstance(entry_or_loaded, Target):
        return Loaded(target=entry_or_loaded, entry="(Target)", module="", function="", path=None, lineno=None)
    return load_target(entry_or_loaded)


@borrows_globals
def scan_data(entry_or_loaded: str | Loaded | Target, *, limit: int | None = None,
              precision: str | Precision | None = None, num_classes: int | None = None,
              config: Config | None = None,
              on_progress: Callable[[int, int | None, int], None] | None = None) -> ScanResult:
    """Check every batch of a target (step k = the k-th batch, as in training) without training.

    ``on_progress(batches_done, total_or_None, problems_found)`` is called after each batch.
    """
    cfg = config or load_config()
    scfg = cfg.scan
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise UsageError(f"--limit {limit} is negative", "--limit", "Give a number of batches >= 0")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                    or num_classes <= 0):
        raise UsageError(f"--num-classes {num_classes} is not a positive integer", "--num-classes",
                         "Give the number of classes of the model's output, e.g. --num-classes 10")
    loaded = _loaded(entry_or_loaded)
    target = loaded.target
    try:
        prec = parse_precision(precision, default=target.precision)
    except ValueError:
        raise UsageError(f"unknown precision {precision!r}", "--precision", "Use one of: fp32, bf16, fp16") from None
    range_max = limits(prec.dtype).max if prec.low else None
    ignore_index = target.ignore_index if target.ignore_index != -100 else scfg.ignore_index
    source = "--num-classes" if num_classes is not None else "target" if target.num_classes is not None else None
    num_classes = num_classes if num_classes is not None else target.num_classes
    notes: list[str] = []
    is_callable = is_callable_batches(target.batches)
    per_epoch = epoch_length(target.batches)
    if limit is None and (is_callable or per_epoch is None):   # without a length it may never end
        limit = scfg.callable_batches
        notes.append((f"batches is a callable: scanned batches(0) .. batches({limit - 1}) at most" if is_callable else
                      f"batches has no length (it may be endless): scanned its first {limit} batches at most")
                     + " (scan.callable_batches); pass --limit to change")
    total = per_epoch * target.epochs if per_epoch is not None else None
    if limit is not None:
        total = limit if total is None else min(total, limit)
    stream = Stream(target, record=False)
    scanner = Scanner(scfg, ignore_index=ignore_index, num_classes=num_classes, range_max=range_max)
    device = None
    draws = False           # does fetching a batch draw from the global torch RNG?

    def fetch(get: Callable[[], Any], counts: Callable[[Any], bool] = lambda got: True) -> Any:
        nonlocal draws
        rng_before = torch.get_rng_state() if not draws and scanner.batches < 64 else None
        got = get()
        if rng_before is not None and got is not None and counts(got) \
                and not torch.equal(rng_before, torch.get_rng_state()):
            draws = True
        return got

    def batches():
        """(step, micro-batch, batch) in training order. An epoch's first fetch draws in training too (iter() of
        a DataLoader: its base seed), at the same point; only draws on later fetches interleave with training's."""
        while True:
            try:   # fetches the step's first batch
                feed = fetch(lambda: stream.open(stream.next_step), lambda f: f.position.index != 0)
            except DataEnd:
                return
            for j in itertools.count():
                batch = feed.get(0) if j == 0 else fetch(lambda: feed.get(j))
                if batch is None:
                    break
                yield feed.step, j, batch

    for k, j, batch in itertools.islice(batches(), limit):
        first = scanner.batches == 0
        if first:
            device = next((t.device for _, t in iter_tensors(batch)), None)
            if scanner.num_classes is None and scfg.infer_num_classes \
                    and any(leaf.role == LABEL for leaf in leaves(batch)) \
                    and sum(p.numel() for p in target.model.parameters()) <= scfg.infer_max_params:
                inferred = infer_num_classes(target, batch)
                if inferred is not None:
                    scanner.num_classes, source = inferred, "model output width"
        before = len(scanner.problems)
        scanner.add(k, batch)
        if target.accumulate > 1:
            scanner.problems[before:] = [dataclasses.replace(p, micro=j) if p.step == k and p.micro is None
                                         else p for p in scanner.problems[before:]]
        if first and source == "model output width" and (dropped := scanner.drop_num_classes()):
            notes.append(dropped)
            source = None
        if on_progress is not None:
            on_progress(scanner.batches, total, scanner.total)
    if stream.end_note and is_callable:
        notes.append(stream.end_note)
    if draws:
        notes.append("fetching batches draws from the global torch RNG (random sampling, a shuffle seed or random "
                     "transforms in this process): training interleaves those draws with its own (dropout, noise), "
                     "so past the first draws scan-data's batches can differ from training's; `nanprobe run` "
                     "replays training's exact batches")
    elif target.epochs > 1 and not is_callable and _shuffles_from_global_rng(target.batches):
        notes.append("epochs after the first are shuffled from the global RNG state that training leaves; "
                     "scan-data does not train, so their batch order can differ from training (nanprobe run "
                     "replays the exact order)")
    # at the limit, a sized iterable may still have been read to its end (all batches of all epochs)
    complete = limit is None or scanner.batches < limit \
        or (not is_callable and per_epoch is not None and per_epoch * target.epochs <= scanner.batches)
    scanner.finish()
    if scanner.batches == 0:
        raise UsageError("batches yielded no batch: nothing was checked", loaded.where,
                         "Give the target at least one batch")
    device = device or device_of(target.model)
    return ScanResult(entry=loaded.entry, device=describe_device(device), precision=prec.value,
                      batches_scanned=scanner.batches, complete=complete, problems=tuple(scanner.problems),
                      problems_total=scanner.total, summary=tuple(k.summary() for k in scanner.keys.values()),
                      num_classes=scanner.num_classes, num_classes_source=source, ignore_index=ignore_index,
                      range_max=range_max, notes=tuple(notes))


def _shuffles_from_global_rng(batches: Any) -> bool:
    """A DataLoader whose order (sampler seed) or worker seeds come from the global torch RNG."""
    samplers = (getattr(batches, "sampler", None), getattr(getattr(batches, "batch_sampler", None), "sampler", None))
    return any(type(smp).__name__ == "RandomSampler" and getattr(smp, "generator", None) is None for smp in samplers)
