"""`nanprobe compare-precisions`: the same step under fp64/fp32/tf32/bf16/fp16(+GradScaler), side by side.

Every precision reruns the step from the same state with the same batch and RNG (``rerun.run_step``),
instrumented (``OriginTracker``: the first non-finite site). Beside it a ``_Capture`` reads every
module's output, the gradient w.r.t. that output and the parameter gradients, and compares them
elementwise with the reference run (fp64 where it runs, else fp32), which goes first and is kept.
Nothing here prints; the CLI renders the ``Comparison``.

Definitions (also written into the JSON under ``definitions``) are in ``DEFINITIONS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from . import __version__
from .batch import iter_tensors
from .config import CompareConfig, Config, load_config
from .diagnose import origin_of
from .entry import Loaded, load_target
from .errors import EXIT_FOUND, EXIT_OK, UsageError
from .instrument import LOSS_FN, Event, Probe
from .loop import Snapshot
from .precision import Precision, describe_device, device_of
from .replay import NoBadStep, Reached, reach
from .report import SCHEMA, Origin, Phase, _num
from .rerun import StepTrace, run_step

CHOICES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp16+scaler")
_RUNS = {"fp64": (Precision.FP64, False), "fp32": (Precision.FP32, False), "tf32": (Precision.TF32, False),
         "bf16": (Precision.BF16, False), "fp16": (Precision.FP16, False), "fp16+scaler": (Precision.FP16, True)}
_ALIASES = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "bfloat16": "bf16",
            "float16": "fp16", "half": "fp16", "fp16-scaler": "fp16+scaler", "fp16_scaler": "fp16+scaler",
            "fp16+gradscaler": "fp16+scaler", "scaler": "fp16+scaler"}
_PREFERENCE = ("bf16", "fp16+scaler", "fp16", "tf32", "fp32")  # what we recommend first when it is safe

DEFINITIONS = {
    "loss_rel_err": "|loss - loss_ref| / |loss_ref|",
    "grad_cosine": "cosine similarity of all parameter gradients, flattened into one vector and unscaled, "
                   "to the reference's",
    "headroom_bits": "log2(max of the tensor's dtype / largest finite |x|) over module outputs (activations) "
                     "and the gradients w.r.t. them (as held during backward: times the loss scale under "
                     "GradScaler); below 0 means overflow. For a module that went non-finite, the magnitude "
                     "the reference reached there ('would_reach', the origin op's output where probed) is used",
    "underflow.gradients": "share of parameter-gradient elements that are non-zero in the reference (|x| >= "
                           "float32's smallest normal, 1.18e-38) and, in "
                           "this precision (scaled values under GradScaler), zero or below the smallest normal "
                           "of its compute dtype while exactly representable in it (with autocast the grads "
                           "are float32 but their values came through fp16/bf16: a subnormal there); parameters "
                           "whose reference gradient norm is below 1e-6 of the total are left out (rounding noise)",
    "underflow.activation_gradients": "the same for the gradients w.r.t. module outputs (what backward carries "
                                      "between modules), judged in the dtype they have during backward",
    "underflow.activations": "the same for module outputs in the forward pass, judged in their dtype",
    "underflow.origin_inputs": "where a precision went non-finite in the forward pass: share of the origin op's "
                               "input elements, non-zero in the reference, that are zero or subnormal there (both "
                               "probed): the underflow inside a module that fed a log/div",
    "underflow.max": "the largest of the shares above",
    "underflow_explains": "share of the origin op's non-finite outputs at whose position an input underflowed "
                          "(1.0: the underflow is the whole cause)",
    "out_rel_err": "||y - y_ref|| / ||y_ref|| over a module's outputs (all its calls)",
    "param_grad_rel_err": "||g - g_ref|| / ||g_ref|| over a module's own parameters (unscaled); null where the "
                          "module's reference gradient norm is below 1e-6 of the total (it carries no signal)",
    "scaler.settled_scale": "largest loss scale, halving from the step's scale as GradScaler does, at which "
                            "this step is not skipped (null: none within compare.max_scale_halvings)",
}


def parse_precisions(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """'bf16,fp16' -> ('bf16', 'fp16'); None -> all. Canonical order; unknown names are a UsageError."""
    if value is None:
        return CHOICES
    items = value.split(",") if isinstance(value, str) else list(value)
    names = []
    for item in items:
        raw = str(item).strip().lower()
        if not raw:
            continue
        name = _ALIASES.get(raw, raw)
        if name not in CHOICES:
            raise UsageError(f"unknown precision {item.strip()!r}", "--precisions",
                             f"Choose from {', '.join(CHOICES)} (comma-separated)")
        names.append(name)
    if not names:
        raise UsageError("no precision given", "--precisions", f"Choose from {', '.join(CHOICES)}")
    return tuple(n for n in CHOICES if n in names)


# -- records ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class ScalerResult:
    scale: float                   # loss scale the step starts with
    skipped: bool                  # GradScaler skips this step at that scale
    scale_after: float | None      # after this step's update()
    settled_scale: float | None    # largest scale (halving) at which the step is not skipped
    halvings: int                  # halvings to get there
    overflow: Origin | None = None  # the first non-finite site at the starting scale

    def to_json(self) -> dict[str, Any]:
        return {"scale": _num(self.scale), "skipped": self.skipped, "scale_after": _num(self.scale_after),
                "settled_scale": _num(self.settled_scale), "halvings": self.halvings,
                "overflow": self.overflow.to_json() if self.overflow else None}


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerStat:
    """One module in one precision."""

    dtype: str | None              # dtype of the module's output
    out_absmax: float | None
    out_finite: bool
    out_rel_err: float | None
    out_underflow: float | None
    grad_absmax: float | None      # d loss / d output, as held (scaled under GradScaler)
    grad_finite: bool
    grad_underflow: float | None
    param_grad_rel_err: float | None
    out_headroom_bits: float | None
    grad_headroom_bits: float | None
    out_would_reach: float | None = None   # non-finite here: what the reference reaches (the probed op's output)
    grad_would_reach: float | None = None

    @property
    def headroom_bits(self) -> float | None:
        values = [v for v in (self.out_headroom_bits, self.grad_headroom_bits) if v is not None]
        return min(values) if values else None

    @property
    def underflow(self) -> float | None:
        values = [v for v in (self.out_underflow, self.grad_underflow) if v is not None]
        return max(values) if values else None

    def to_json(self) -> dict[str, Any]:
        return {k: (_num(v) if isinstance(v, float) else v) for k, v in (
            ("dtype", self.dtype), ("out_absmax", self.out_absmax), ("out_finite", self.out_finite),
            ("out_rel_err", self.out_rel_err), ("out_underflow", self.out_underflow),
            ("grad_absmax", self.grad_absmax), ("grad_finite", self.grad_finite),
            ("grad_underflow", self.grad_underflow), ("param_grad_rel_err", self.param_grad_rel_err),
            ("out_headroom_bits", self.out_headroom_bits), ("grad_headroom_bits", self.grad_headroom_bits),
            ("out_would_reach", self.out_would_reach), ("grad_would_reach", self.grad_would_reach))}


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerRow:
    module: str
    order: int                     # forward order (first call) in the reference run
    stats: dict[str, LayerStat]    # precision -> numbers

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "order": self.order,
                "precisions": {k: v.to_json() for k, v in self.stats.items()}}


@dataclass(frozen=True, slots=True, kw_only=True)
class Ranked:
    """One line of a per-layer top-k table."""

    precision: str
    module: str
    value: float | None            # the ranking number: relative error, headroom bits or underflow share
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"precision": self.precision, "module": self.module, "value": _num(self.value), "detail": self.detail}


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionRun:
    name: str
    ran: bool
    reference: bool = False
    dtype: str | None = None               # compute dtype: float16 for fp16 autocast
    note: str | None = None
    supported: bool | None = None          # bf16 on CUDA: torch.cuda.is_bf16_supported()
    loss: float | None = None
    loss_rel_err: float | None = None
    grad_norm: float | None = None
    grad_cosine: float | None = None
    finite: bool | None = None
    origin: Origin | None = None
    would_reach: float | None = None       # reference |value| at the origin op (x loss scale in backward)
    zeros_at_origin: tuple[int, int] | None = None  # zeros in the origin op's inputs: here, in the reference
    act_absmax: float | None = None
    act_module: str | None = None
    act_headroom_bits: float | None = None
    grad_absmax: float | None = None
    grad_module: str | None = None
    grad_headroom_bits: float | None = None
    underflow_grads: float | None = None
    underflow_act_grads: float | None = None
    underflow_acts: float | None = None
    underflow_origin: float | None = None  # share of the origin op's input elements zero here, not in the reference
    underflow_explains: float | None = None  # share of the origin op's non-finite outputs fed by an underflow
    scaler: ScalerResult | None = None

    @property
    def underflow(self) -> float | None:
        """The largest of the underflow shares."""
        values = [v for v in (self.underflow_grads, self.underflow_act_grads, self.underflow_acts,
                              self.underflow_origin) if v is not None]
        return max(values) if values else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ran": self.ran, "reference": self.reference, "dtype": self.dtype}
        if not self.ran:
            out["note"] = self.note
            return out
        out.update({
            "loss": _num(self.loss), "loss_rel_err": _num(self.loss_rel_err), "grad_norm": _num(self.grad_norm),
            "grad_cosine": _num(self.grad_cosine), "finite": self.finite,
            "origin": self.origin.to_json() if self.origin else None, "would_reach": _num(self.would_reach),
            "absmax": {"activations": _num(self.act_absmax), "activation_module": self.act_module,
                       "gradients": _num(self.grad_absmax), "gradient_module": self.grad_module},
            "headroom_bits": {"activations": _num(self.act_headroom_bits),
                              "gradients": _num(self.grad_headroom_bits)},
            "underflow": {"gradients": _num(self.underflow_grads),
                          "activation_gradients": _num(self.underflow_act_grads),
                          "activations": _num(self.underflow_acts), "origin_inputs": _num(self.underflow_origin),
                          "max": _num(self.underflow)},
        })
        if self.zeros_at_origin is not None:
            out["zeros_at_origin"] = {"here": self.zeros_at_origin[0], "reference": self.zeros_at_origin[1]}
        if self.underflow_explains is not None:
            out["underflow_explains"] = _num(self.underflow_explains)
        if self.scaler is not None:
            out["scaler"] = self.scaler.to_json()
        if self.supported is not None:
            out["supported"] = self.supported
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    entry: str
    step: int
    device: str
    precision: str                       # what the target trains in (the replay's precision)
    reference: str                       # fp64, or fp32 where fp64 could not run
    precisions: dict[str, PrecisionRun]
    layers: tuple[LayerRow, ...]
    least_accurate: tuple[Ranked, ...]
    closest_to_overflow: tuple[Ranked, ...]
    deepest_underflow: tuple[Ranked, ...]
    recommendation: str
    recommended: str | None
    notes: tuple[str, ...] = ()
    reached_by: str | None = None
    autocast_policy: str | None = None

    @property
    def finite(self) -> bool:
        return all(r.finite for r in self.precisions.values() if r.ran)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.finite else EXIT_FOUND

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "nanprobe": __version__, "command": "compare-precisions", "entry": self.entry,
            "step": self.step, "status": "finite" if self.finite else "nonfinite", "device": self.device,
            "precision": self.precision, "reference": self.reference,
            "precisions": {k: v.to_json() for k, v in self.precisions.items()},
            "layers": {"modules": [r.to_json() for r in self.layers],
                       "least_accurate": [r.to_json() for r in self.least_accurate],
                       "closest_to_overflow": [r.to_json() for r in self.closest_to_overflow],
                       "deepest_underflow": [r.to_json() for r in self.deepest_underflow]},
            "recommendation": self.recommendation, "recommended": self.recommended,
            "notes": list(self.notes), "reached_by": self.reached_by, "autocast_policy": self.autocast_policy,
            "definitions": dict(DEFINITIONS),
        }


# -- capture: module outputs, their gradients and the parameter gradients of one rerun -----------------

ROOT = "(model)"
# "non-zero in the reference" means |ref| >= float32's smallest normal: an fp64 reference holds values
# (e.g. exp(-700) in a saturated softmax) that no training precision keeps, and they weigh nothing.
_FLOOR = float(torch.finfo(torch.float32).tiny)
# per-row numbers: absmax (finite), non-finite count, sum (y-ref)^2, sum ref^2, underflowed, ref non-zero, dot, sum y^2
_W = 8


@contextlib.contextmanager
def _quiet(device_type: str):
    """Our own measuring ops: no autograd, no autocast, invisible to the OriginTracker's modes."""
    with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes(), \
            torch.autocast(device_type, enabled=False):
        yield


@dataclass(slots=True)
class _Store:
    """What the reference run keeps for the elementwise comparisons."""

    budget: int                                           # bytes for outputs and gradient masks
    used: int = 0
    outputs: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    grad_masks: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    full: bool = False

    def fits(self, t: torch.Tensor, itemsize: int) -> bool:
        need = t.numel() * itemsize
        if self.used + need > self.budget:
            self.full = True
            return False
        self.used += need
        return True


@dataclass(slots=True)
class _Row:
    kind: str            # out | grad | param
    module: str
    unique: bool         # first time this tensor is counted (a Sequential's output is its last child's)
    dtype: str
    compared: bool
    values: torch.Tensor


class _Capture:
    def __init__(self, model: torch.nn.Module, store: _Store, *, reference: bool, low: torch.dtype, scale: float,
                 device_type: str):
        self.names = {id(m): (name or ROOT) for name, m in model.named_modules()}
        self.params = list(model.named_parameters())
        self.store, self.reference, self.low, self.scale = store, reference, low, scale
        self.device_type = device_type
        self.phase: Phase | None = None
        self.calls: dict[str, int] = {}
        self.order: list[str] = []
        self.rows: list[_Row] = []
        self._alive: dict[int, torch.Tensor] = {}
        self._ref_by_id: dict[int, torch.Tensor] = {}
        self._handle = None

    def __enter__(self) -> _Capture:
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._forward, always_call=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._alive.clear()
        self._ref_by_id.clear()

    def observe(self, phase: Phase) -> None:
        self.phase = phase
        if phase is not Phase.FORWARD:
            self._alive.clear()
            self._ref_by_id.clear()
        if phase is Phase.UPDATE:
            with _quiet(self.device_type):
                self._param_grads()

    def _forward(self, module, args, output) -> None:
        name = self.names.get(id(module))
        if name is None or self.phase is not Phase.FORWARD:
            return
        t = next((x for _, x in iter_tensors(output) if x.is_floating_point() and x.numel() > 0), None)
        if t is None:
            return
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        if call == 0:
            self.order.append(name)
        key = (name, call)
        unique = id(t) not in self._alive
        self._alive[id(t)] = t
        with _quiet(self.device_type):
            self._tensor("out", key, t.detach(), unique, id(t))
        if t.requires_grad:
            t.register_hook(lambda g, key=key, unique=unique: self._grad(key, g, unique))

    def _grad(self, key: tuple[str, int], g: torch.Tensor, unique: bool) -> None:
        with _quiet(self.device_type):
            self._tensor("grad", key, g.detach(), unique, None)

    def _tensor(self, kind: str, key: tuple[str, int], t: torch.Tensor, unique: bool, ident: int | None) -> None:
        a = t.abs()
        finite = torch.isfinite(a)
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        absmax = torch.where(finite, a, zero).amax().double()
        nonfinite = (~finite).sum().double()
        small = a < torch.finfo(t.dtype).tiny            # zero or subnormal in its own dtype
        nought = torch.zeros((), dtype=torch.float64, device=t.device)
        diff2 = ref2 = under = count = nought
        compared = False
        store = self.store
        if self.reference:
            if kind == "out":
                kept = self._ref_by_id.get(ident) if ident is not None else None
                if kept is None and store.fits(t, t.element_size()):
                    kept = t.clone()
                    self._ref_by_id[ident] = kept
                if kept is not None:
                    store.outputs[key] = kept
                ref2 = t.double().square().sum()
            elif store.fits(t, 1):
                store.grad_masks[key] = t.abs() >= _FLOOR
            count = (t.abs() >= _FLOOR).sum().double()
            compared = True
        else:
            ref = (store.outputs if kind == "out" else store.grad_masks).get(key)
            if ref is not None and ref.shape == t.shape:
                if kind == "out":
                    r = ref.double()
                    diff2 = (t.double() - r).square().sum()
                    ref2 = r.square().sum()
                    nz = ref.abs() >= _FLOOR
                else:
                    nz = ref
                under = (nz & small).sum().double()
                count = nz.sum().double()
                compared = True
        self.rows.append(_Row(kind=kind, module=key[0], unique=unique, dtype=str(t.dtype).replace("torch.", ""),
                              compared=compared,
                              values=torch.stack([absmax, nonfinite, diff2, ref2, under, count, nought, nought])))

    def _param_grads(self) -> None:
        tiny = torch.finfo(self.low).tiny
        for name, p in self.params:
            g = p.grad
            if g is None:
                continue
            g = g.detach()
            module = name.rpartition(".")[0] or ROOT
            a = g.abs()
            finite = torch.isfinite(a)
            absmax = torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device)).amax().double()
            nonfinite = (~finite).sum().double()
            nought = torch.zeros((), dtype=torch.float64, device=g.device)
            if self.reference:
                self.store.grads[name] = g.clone()
                r = g.double()
                row = [absmax, nonfinite, nought, r.square().sum(), nought, (g.abs() >= _FLOOR).sum().double(),
                       r.square().sum(), r.square().sum()]
                compared = True
            else:
                ref = self.store.grads.get(name)
                compared = ref is not None and ref.shape == g.shape
                if not compared:
                    row = [absmax, nonfinite] + [nought] * 6
                else:
                    r = ref.double()
                    gu = g.double() / self.scale
                    if g.dtype == self.low:
                        small = a < tiny
                    else:  # zero, or a subnormal of the compute dtype that came through it exactly
                        small = (a == 0) | ((a < tiny) & (g.to(self.low).to(g.dtype) == g))
                    nz = ref.abs() >= _FLOOR
                    row = [absmax, nonfinite, (gu - r).square().sum(), r.square().sum(), (nz & small).sum().double(),
                           nz.sum().double(), (gu * r).sum(), gu.square().sum()]
            self.rows.append(_Row(kind="param", module=module, unique=True, dtype=str(g.dtype).replace("torch.", ""),
                                  compared=compared, values=torch.stack(row)))

    def finish(self) -> _Measured:
        values: list[list[float]] = []
        if self.rows:
            try:  # one device sync for the whole run
                values = torch.stack([r.values for r in self.rows]).tolist()
            except RuntimeError:  # rows on several devices (a model split across GPUs)
                values = torch.stack([r.values.cpu() for r in self.rows]).tolist()
        return _Measured.build(self.rows, values, self.order)


@dataclass(slots=True)
class _Agg:
    absmax: float = 0.0
    nonfinite: float = 0.0
    diff2: float = 0.0
    ref2: float = 0.0
    under: float = 0.0
    count: float = 0.0
    dot: float = 0.0
    sq: float = 0.0
    compared: bool = False
    dtype: str | None = None

    def add(self, v: list[float], compared: bool, dtype: str) -> None:
        self.absmax = max(self.absmax, v[0])
        self.nonfinite += v[1]
        if compared:
            self.diff2 += v[2]
            self.ref2 += v[3]
            self.under += v[4]
            self.count += v[5]
            self.dot += v[6]
            self.sq += v[7]
            self.compared = True
        self.dtype = self.dtype or dtype

    @property
    def rel_err(self) -> float | None:
        if not self.compared:
            return None
        if not math.isfinite(self.diff2):
            return math.inf
        if self.ref2 == 0:
            return 0.0 if self.diff2 == 0 else math.inf
        return math.sqrt(self.diff2 / self.ref2)

    @property
    def underflow(self) -> float | None:
        return self.under / self.count if self.compared and self.count > 0 else None


@dataclass(slots=True)
class _Measured:
    order: list[str]
    modules: dict[str, dict[str, _Agg]]       # module -> kind -> aggregate
    totals: dict[str, _Agg]                   # kind -> aggregate over unique tensors

    @property
    def nonfinite(self) -> bool:
        return any(agg.nonfinite for aggs in self.modules.values() for agg in aggs.values())

    @classmethod
    def build(cls, rows: list[_Row], values: list[list[float]], order: list[str]) -> _Measured:
        modules: dict[str, dict[str, _Agg]] = {}
        totals = {k: _Agg() for k in ("out", "grad", "param")}
        total_ref2 = sum(v[3] for row, v in zip(rows, values) if row.kind == "param")
        for row, v in zip(rows, values):
            if row.kind == "param" and v[3] < 1e-12 * total_ref2:
                v[4] = v[5] = 0.0  # a parameter whose reference gradient is ~0 (e.g. softmax-invariant) has no signal
            modules.setdefault(row.module, {}).setdefault(row.kind, _Agg()).add(v, row.compared, row.dtype)
            if row.unique:
                totals[row.kind].add(v, row.compared, row.dtype)
        return cls(order=order, modules=modules, totals=totals)


class _LossTap:
    """Wraps loss_fn to keep the loss at full precision (the step's record rounds it to float32)."""

    def __init__(self, fn):
        self.fn = fn
        self.loss: torch.Tensor | None = None

    def __call__(self, model, batch):
        loss = self.fn(model, batch)
        if isinstance(loss, torch.Tensor):
            self.loss = loss.detach()
        return loss


def _floats(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


class _OpProbe(TorchDispatchMode):
    """Copies the floating inputs and the output's largest finite |x| of one forward op call: ``op`` in
    ``module``, its ``occurrence``-th call there, named and counted as the OriginTracker does."""

    def __init__(self, model: torch.nn.Module, module: str | None, op: str, occurrence: int):
        super().__init__()
        self.names = {id(m): name for name, m in model.named_modules()}
        self.module, self.op, self.occurrence = module, op, occurrence
        self.stack: list[str] = []
        self.count = 0
        self.active = False
        self.inputs: list[torch.Tensor] | None = None
        self.out_absmax: float | None = None
        self.out_bad: torch.Tensor | None = None    # where the first floating output is non-finite
        self._handles: list[Any] = []

    def observe(self, phase: Phase) -> None:
        self.active = phase is Phase.FORWARD

    def __enter__(self):
        mm = torch.nn.modules.module
        self._handles = [mm.register_module_forward_pre_hook(self._pre),
                         mm.register_module_forward_hook(self._post, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return super().__exit__(*exc)

    def _pre(self, module, args) -> None:
        name = self.names.get(id(module))
        if name is not None and self.active:
            self.stack.append(name)

    def _post(self, module, args, output) -> None:
        name = self.names.get(id(module))
        if name is not None and self.active and self.stack and self.stack[-1] == name:
            self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.active and self.inputs is None and str(func) == self.op \
                and (self.stack[-1] if self.stack else LOSS_FN) == self.module and _floats(out):
            if self.count == self.occurrence:
                self.inputs = [t.detach().clone() for t in _floats((args, kwargs))]
                outs = _floats(out)
                a = torch.stack([torch.where(torch.isfinite(t), t.abs(), 0).amax().double() for t in outs])
                self.out_absmax = float(a.max().item())
                self.out_bad = ~torch.isfinite(outs[0].detach())
            self.count += 1
        return out


@dataclass(slots=True)
class _OriginProbe:
    """The origin op of a non-finite precision, seen again in the reference (and there)."""

    would_reach: float | None           # the reference's largest |output| of that op
    zeros: tuple[int, int] | None       # zeros among its inputs: here, in the reference
    underflow: float | None             # input elements >= floor in the reference, zero/subnormal here
    explains: float | None = None       # share of its non-finite outputs whose input underflowed


def _input_underflow(here: _OpProbe, ref: _OpProbe) -> _OriginProbe:
    zeros_here = zeros_ref = under = count = 0
    bad = here.out_bad
    hit = torch.zeros_like(bad) if bad is not None else None
    for x, r in zip(here.inputs, ref.inputs):
        if x.shape != r.shape:
            continue
        nz = r.abs() >= _FLOOR
        flushed = nz & (x.abs() < torch.finfo(x.dtype).tiny)
        zeros_here += int((x == 0).sum())
        zeros_ref += int((r == 0).sum())
        under += int(flushed.sum())
        count += int(nz.sum())
        if hit is not None and flushed.shape == hit.shape:
            hit |= flushed
    n_bad = int(bad.sum()) if bad is not None else 0
    explains = int((hit & bad).sum()) / n_bad if n_bad else None
    return _OriginProbe(would_reach=ref.out_absmax, zeros=(zeros_here, zeros_ref),
                        underflow=under / count if count else None, explains=explains)


# -- running the precisions -----------------------------------------------------------------------------

@dataclass(slots=True)
class _Run:
    name: str
    trace: StepTrace
    measured: _Measured | None
    loss: float | None
    scale: float = 1.0


def _dtype_max(dtype_name: str | None) -> float:
    return float(torch.finfo(getattr(torch, dtype_name)).max) if dtype_name else math.inf


def _bits(limit: float, absmax: float | None) -> float | None:
    if absmax is None or absmax <= 0 or not math.isfinite(limit):
        return None
    if not math.isfinite(absmax):
        return -math.inf
    return math.log2(limit) - math.log2(absmax)


def _pow2(x: float) -> str:
    e = math.log2(x)
    return f"2^{round(e)}" if abs(e - round(e)) < 0.05 else f"2^{e:.1f}"


def _pct(x: float) -> str:
    p = 100 * x
    return "<0.01%" if p < 0.01 else f"{p:.0f}%" if p >= 10 else f"{p:.2g}%"


class _Comparer:
    def __init__(self, loaded: Loaded, reached: Reached, cfg: CompareConfig, progress: Callable[[str], None]):
        self.loaded, self.target, self.reached, self.cfg, self.progress = loaded, loaded.target, reached, cfg, progress
        self.device = device_of(self.target.model)
        self.store = _Store(budget=int(cfg.max_reference_mb * 2 ** 20))
        base = reached.snapshot.scaler or torch.amp.GradScaler(self.device.type).state_dict()
        self.scaler_state = dict(base)

    def _with_scale(self, scale: float) -> Reached:
        state = dict(self.scaler_state, scale=scale, _growth_tracker=0)
        return dataclasses.replace(self.reached, scaler=None,
                                   snapshot=dataclasses.replace(self.reached.snapshot, scaler=state))

    def run(self, name: str, *, reference: bool, tolerate: bool, scale: float | None = None) -> _Run:
        prec, scaler = _RUNS[name]
        scale = (float(self.scaler_state["scale"]) if scale is None else scale) if scaler else 1.0
        reached = self._with_scale(scale) if scaler else self.reached
        tap = _LossTap(self.target.loss_fn)
        target = dataclasses.replace(self.target, loss_fn=tap)
        cap = _Capture(self.target.model, self.store, reference=reference, low=prec.dtype, scale=scale,
                       device_type=self.device.type)
        self.progress(f"rerunning step {self.reached.step} in {name}" + (" (reference)" if reference else ""))
        with cap:
            trace = run_step(target, reached, prec, where=self.loaded.where, instrument=False, grad_scaler=scaler,
                             tolerate_errors=tolerate, observe=cap.observe)
        if trace.error:
            return _Run(name=name, trace=trace, measured=None, loss=None, scale=scale)
        measured = cap.finish()
        loss = float(tap.loss.double().item()) if tap.loss is not None else None
        if not trace.finite or measured.nonfinite:  # only then is the origin tracker's cost worth paying
            self.progress(f"step {self.reached.step} is non-finite in {name}: rerunning it instrumented")
            traced = run_step(self.target, reached, prec, where=self.loaded.where, instrument=True,
                              grad_scaler=scaler, tolerate_errors=True)
            if not traced.error:
                trace = traced
        return _Run(name=name, trace=trace, measured=measured, loss=loss, scale=scale)

    def settle(self, run: _Run) -> tuple[ScalerResult, _Run | None]:
        """Would GradScaler skip this step, and at which scale (halving as it does) would it pass?
        Where it passes only at a lower scale, the step is rerun there, measured: that is what training sees."""
        rec = run.trace.record
        start = run.scale
        if rec is None or not rec.skipped:
            return ScalerResult(scale=start, skipped=False, scale_after=rec.scale if rec else None,
                                settled_scale=start, halvings=0), None
        result = dict(scale=start, skipped=True, scale_after=rec.scale,
                      overflow=origin_of(run.trace.origin, "fp16+scaler"))
        if run.loss is None or not math.isfinite(run.loss):  # the forward overflows: no scale helps
            return ScalerResult(**result, settled_scale=None, halvings=0), None
        backoff = float(self.scaler_state.get("backoff_factor", 0.5))
        scale = start
        for halving in range(1, self.cfg.max_scale_halvings + 1):
            scale *= backoff
            self.progress(f"GradScaler skips step {self.reached.step}: trying loss scale {scale:g}")
            t = run_step(self.target, self._with_scale(scale), Precision.FP16, where=self.loaded.where,
                         instrument=False, grad_scaler=True, tolerate_errors=True)  # the skip flag is enough
            if t.record is not None and not t.record.skipped:
                settled = self.run("fp16+scaler", reference=False, tolerate=True, scale=scale)
                return ScalerResult(**result, settled_scale=scale, halvings=halving), settled
        return ScalerResult(**result, settled_scale=None, halvings=self.cfg.max_scale_halvings), None

    def probe(self, ref_name: str, name: str, run: _Run, event: Event) -> _OriginProbe | None:
        """Rerun the reference (and, for a forward origin, this precision) with a probe on the op that went
        non-finite: the magnitude the reference reaches there, and how its inputs underflowed here."""
        self.progress(f"rerunning step {self.reached.step} in {ref_name} with a probe on {event.op}")
        if event.phase is Phase.BACKWARD:  # the OriginTracker's probe names backward ops by autograd node
            probe = Probe(phase=event.phase, module=event.module, op=event.op, occurrence=event.occurrence,
                          node=event.node)
            run_step(self.target, self.reached, _RUNS[ref_name][0], where=self.loaded.where, instrument=True,
                     probe=probe, tolerate_errors=True)
            return _OriginProbe(would_reach=probe.out_absmax * run.scale, zeros=None, underflow=None) \
                if probe.found and probe.out_absmax is not None else None
        ref = self._op_inputs(ref_name, self.reached, event)
        if ref.inputs is None:
            return None
        here = self._op_inputs(name, self._with_scale(run.scale) if _RUNS[name][1] else self.reached, event)
        if here.inputs is None:
            return _OriginProbe(would_reach=ref.out_absmax, zeros=None, underflow=None)
        return _input_underflow(here, ref)

    def _op_inputs(self, name: str, reached: Reached, event: Event) -> _OpProbe:
        prec, scaler = _RUNS[name]
        probe = _OpProbe(self.target.model, event.module, event.op, event.occurrence)
        with probe:
            run_step(self.target, reached, prec, where=self.loaded.where, instrument=False, grad_scaler=scaler,
                     tolerate_errors=True, observe=probe.observe)
        return probe


def _reach(loaded: Loaded, at: int | None, cfg: Config, progress: Callable[[str], None],
           policy: str) -> tuple[Reached, list[str]]:
    target = loaded.target
    kwargs = dict(precision=target.precision, cfg=cfg.replay, where=loaded.where, policy=policy,
                  on_progress=lambda s: progress(f"replayed step {s}"))
    progress("replaying")
    if at is not None:
        return reach(target, at=at, **kwargs), []
    start = Snapshot.take(target, None)
    try:
        reached = reach(target, at=None, **kwargs)
        return reached, [f"no --at: comparing step {reached.step}, the first bad step in {target.precision.value} "
                         f"({reached.reason})"]
    except NoBadStep as done:
        if done.steps == 0:
            raise UsageError("batches yielded no batch", loaded.where, "Give the target at least one batch") from None
        start.restore(target, None)
        last = done.steps - 1
        reached = reach(target, at=last, **kwargs)
        return reached, [f"no --at and no bad step in {done.steps} replayed steps: comparing the last one "
                         f"({last}); pick another with --at"]


# -- the library call ------------------------------------------------------------------------------------

def compare_precisions(entry_or_loaded: str | Loaded, *, at: int | None = None,
                       precisions: str | Iterable[str] | None = None, top: int | None = None,
                       config: Config | None = None, on_progress: Callable[[str], None] | None = None,
                       policy: str = "native") -> Comparison:
    """Rerun one step under each precision from the same state and batch; compare with the reference.

    ``at`` None compares the first bad step of a replay in the target's precision (else the last
    replayed step). ``precisions`` picks a subset of ``CHOICES``; the reference (fp64, else fp32)
    always runs. The user's objects end in the pre-step state with their original dtypes.
    """
    cfg = config or load_config()
    ccfg = cfg.compare
    names = parse_precisions(precisions)
    k = ccfg.top if top is None else top
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UsageError(f"--top {top} is not a positive count", "--top", "Give a number of modules >= 1")
    progress = on_progress or (lambda msg: None)
    loaded = entry_or_loaded if isinstance(entry_or_loaded, Loaded) else load_target(entry_or_loaded)
    target = loaded.target
    reached, notes = _reach(loaded, at, cfg, progress, policy)
    cmp = _Comparer(loaded, reached, ccfg, progress)
    device = cmp.device
    notes = list(reached.notes) + notes

    # the reference: fp64 where it runs, else fp32
    runs: dict[str, _Run] = {}
    skipped: dict[str, str] = {}
    ref_name = "fp64"
    if device.type == "mps":
        skipped["fp64"] = "MPS has no float64"
    else:
        try:
            run = cmp.run("fp64", reference=True, tolerate=True)
        except torch.OutOfMemoryError:
            run = None
            skipped["fp64"] = "float64 copy of the model does not fit in memory"
        if run is not None and run.trace.error:
            skipped["fp64"] = f"fp64 rerun failed: {run.trace.error}"
        elif run is not None:
            runs["fp64"] = run
    if "fp64" in skipped:
        ref_name = "fp32"
        cmp.store = _Store(budget=cmp.store.budget)
        notes.append(f"reference is fp32: {skipped['fp64']}")
        runs["fp32"] = cmp.run("fp32", reference=True, tolerate=False)
    for name in names:
        if name in runs or name in skipped:
            continue
        if name == "tf32" and device.type != "cuda":
            skipped[name] = f"tf32 is a CUDA tensor-core mode; skipped on {device.type}"
            continue
        if name == "fp16+scaler" and target.optimizer is None:
            skipped[name] = "GradScaler needs an optimizer; the target has none"
            continue
        runs[name] = cmp.run(name, reference=False, tolerate=True)

    scaler = None
    if "fp16+scaler" in runs and not runs["fp16+scaler"].trace.error:
        scaler, settled = cmp.settle(runs["fp16+scaler"])
        if settled is not None and not settled.trace.error:
            runs["fp16+scaler"] = settled  # the numbers at the scale GradScaler settles on
    bf16_ok = None
    if device.type == "cuda" and "bf16" in names:
        bf16_ok = bool(torch.cuda.is_bf16_supported())
        if not bf16_ok:
            notes.append("this GPU does not support bf16 natively (torch.cuda.is_bf16_supported() is False)")

    # probe the reference at the first non-finite low-precision origin: the magnitude it would reach
    probes: dict[str, _OriginProbe] = {}
    seen: dict[tuple, _OriginProbe | None] = {}
    for name in ("fp16", "fp16+scaler", "bf16", "tf32", "fp32"):
        run = runs.get(name)
        e = run.trace.origin if run is not None and not run.trace.error else None
        if e is None or e.phase not in (Phase.FORWARD, Phase.BACKWARD) or name == ref_name:
            continue
        key = (e.phase, e.module, e.op, e.occurrence, e.node, _RUNS[name][0], run.scale if e.phase is
               Phase.BACKWARD else 1.0)  # fp16 and fp16+scaler share a forward
        if key not in seen:
            seen[key] = cmp.probe(ref_name, name, run, e)
        if seen[key] is not None:
            probes[name] = seen[key]

    results = _results(runs, skipped, names, ref_name, probes, scaler, bf16_ok)
    layers = _layers(runs, ref_name, results)
    least, over, under = _rank(layers, ref_name, k, results)
    bad_input = [path for path, t in iter_tensors(reached.batch) if t.is_floating_point()
                 and not bool(torch.isfinite(t).all())] if not results[ref_name].finite else []
    recommended, line = _recommend(results, ref_name, ccfg, loaded.entry, reached.step, bad_input)
    policy_text = None
    if any(_RUNS[n][0].autocast for n in runs):
        policy_text = (f"CUDA autocast op list emulated on {device.type}" if reached.policy == "cuda"
                       and device.type == "cpu" else f"native {device.type} autocast")
    return Comparison(entry=loaded.entry, step=reached.step, device=describe_device(device),
                      precision=reached.precision.value, reference=ref_name, precisions=results, layers=layers,
                      least_accurate=least, closest_to_overflow=over, deepest_underflow=under,
                      recommendation=line, recommended=recommended, notes=tuple(notes),
                      reached_by=reached.reached_by, autocast_policy=policy_text)


def _results(runs: dict[str, _Run], skipped: dict[str, str], names: tuple[str, ...], ref_name: str,
             probes: dict[str, _OriginProbe], scaler: ScalerResult | None,
             bf16_ok: bool | None) -> dict[str, PrecisionRun]:
    ref = runs[ref_name]
    out: dict[str, PrecisionRun] = {}
    for name in CHOICES:
        if name != ref_name and name not in names:
            continue
        prec, _ = _RUNS[name]
        dtype = str(prec.dtype).replace("torch.", "")
        if name in skipped:
            out[name] = PrecisionRun(name=name, ran=False, dtype=dtype, note=skipped[name])
            continue
        run = runs[name]
        t = run.trace
        if t.error:
            out[name] = PrecisionRun(name=name, ran=False, dtype=dtype, note=f"could not run: {t.error}")
            continue
        m = run.measured
        rec = t.record
        e = t.origin
        finite = bool(rec.finite and not (t.trace and t.trace.events) and not m.nonfinite)
        sc = scaler if name == "fp16+scaler" else None
        if sc is not None and sc.skipped and sc.settled_scale is None:
            finite = False  # GradScaler's own skips are its normal business, unless no scale lets the step pass
        probe = probes.get(name) if e is not None else None
        would, zeros, under_origin, explains = (probe.would_reach, probe.zeros, probe.underflow, probe.explains) \
            if probe else (None,) * 4
        acts = _extreme(m, "out")
        grads = _extreme(m, "grad")
        loss_err = cos = None
        if run.loss is not None and ref.loss is not None:
            loss_err = abs(run.loss - ref.loss) / abs(ref.loss) if ref.loss != 0 else abs(run.loss - ref.loss)
            if math.isnan(loss_err):
                loss_err = math.inf
        p = m.totals["param"]
        if p.compared:
            denom = math.sqrt(p.sq * p.ref2)
            cos = p.dot / denom if denom > 0 and math.isfinite(denom) else None
            if name == ref_name:
                cos = 1.0
        act_bits = _bits(_dtype_max(acts[2]), acts[0])
        grad_bits = _bits(_dtype_max(grads[2]), grads[0])
        if would is not None and e is not None:
            limit = _dtype_max(e.out_dtype)
            bits = _bits(limit, would)
            if e.phase is Phase.FORWARD and (act_bits is None or (bits is not None and bits < act_bits)):
                act_bits = bits
            if e.phase is Phase.BACKWARD and (grad_bits is None or (bits is not None and bits < grad_bits)):
                grad_bits = bits
        out[name] = PrecisionRun(
            name=name, ran=True, reference=name == ref_name, dtype=dtype, loss=run.loss,
            loss_rel_err=0.0 if name == ref_name else loss_err, grad_norm=rec.grad_norm, grad_cosine=cos,
            finite=finite, origin=origin_of(e, name), would_reach=would, zeros_at_origin=zeros,
            act_absmax=acts[0], act_module=acts[1], act_headroom_bits=act_bits,
            grad_absmax=grads[0], grad_module=grads[1], grad_headroom_bits=grad_bits,
            underflow_grads=m.totals["param"].underflow, underflow_act_grads=m.totals["grad"].underflow,
            underflow_acts=m.totals["out"].underflow, underflow_origin=under_origin,
            underflow_explains=explains, scaler=sc,
            supported=bf16_ok if name == "bf16" else None)
    return out


def _extreme(m: _Measured, kind: str) -> tuple[float | None, str | None, str | None]:
    """Largest finite |x| of a kind over modules: (absmax, module, dtype), judged by headroom in its dtype."""
    best = (None, None, None)
    best_bits = math.inf
    for module in m.order:
        agg = m.modules.get(module, {}).get(kind)
        if agg is None or agg.absmax <= 0:
            continue
        bits = _bits(_dtype_max(agg.dtype), agg.absmax)
        if bits is not None and bits < best_bits:
            best, best_bits = (agg.absmax, module, agg.dtype), bits
    return best


def _layers(runs: dict[str, _Run], ref_name: str, results: dict[str, PrecisionRun]) -> tuple[LayerRow, ...]:
    order = list(runs[ref_name].measured.order)
    for run in runs.values():
        if run.measured is not None:
            order += [n for n in run.measured.order if n not in order]
    ref_mods = runs[ref_name].measured.modules
    total_ref2 = runs[ref_name].measured.totals["param"].ref2
    rows = []
    for i, module in enumerate(order):
        stats = {}
        ref_aggs = ref_mods.get(module, {})
        for name, run in runs.items():
            aggs = run.measured.modules.get(module) if run.measured is not None else None
            if not aggs:
                continue
            out, grad, param = aggs.get("out"), aggs.get("grad"), aggs.get("param")
            dtype = out.dtype if out else None
            out_would = grad_would = None
            if out is not None and out.nonfinite and ref_aggs.get("out") is not None:
                out_would = ref_aggs["out"].absmax            # what the output reaches in the reference
            if grad is not None and grad.nonfinite and ref_aggs.get("grad") is not None:
                grad_would = ref_aggs["grad"].absmax * run.scale
            r = results.get(name)
            if r is not None and r.origin is not None and r.origin.module == module and r.would_reach is not None:
                if r.origin.phase is Phase.BACKWARD:          # the origin op itself, probed in the reference
                    grad_would = max(grad_would or 0.0, r.would_reach)
                else:
                    out_would = max(out_would or 0.0, r.would_reach)
            grad_dtype = grad.dtype if grad else None
            if r is not None and r.origin is not None and r.origin.module == module and r.dtype in ("float16",
                                                                                                  "bfloat16"):
                if r.origin.phase is Phase.BACKWARD:
                    grad_dtype = r.dtype
                else:
                    dtype = dtype if dtype in ("float16", "bfloat16") else r.dtype
            out_bits = _bits(_dtype_max(dtype), out_would if out_would is not None else out.absmax if out else None)
            grad_bits = _bits(_dtype_max(grad_dtype),
                              grad_would if grad_would is not None else grad.absmax if grad else None)
            pg = None
            if param is not None and name != ref_name and param.ref2 >= 1e-12 * total_ref2:
                pg = param.rel_err  # modules with a negligible reference gradient carry no signal: left out
            stats[name] = LayerStat(
                dtype=dtype, out_absmax=out.absmax if out else None, out_finite=not (out and out.nonfinite),
                out_rel_err=None if name == ref_name or not out else out.rel_err,
                out_underflow=out.underflow if out and name != ref_name else None,
                grad_absmax=grad.absmax if grad else None, grad_finite=not (grad and grad.nonfinite),
                grad_underflow=grad.underflow if grad and name != ref_name else None,
                param_grad_rel_err=pg, out_headroom_bits=out_bits, grad_headroom_bits=grad_bits,
                out_would_reach=out_would, grad_would_reach=grad_would)
        rows.append(LayerRow(module=module, order=i, stats=stats))
    return tuple(rows)


def _rank(layers: tuple[LayerRow, ...], ref_name: str, k: int, results: dict[str, PrecisionRun]):
    """Top-k (precision, module) by error, by headroom (ascending) and by underflow share."""
    least, over, under = [], [], []
    origin_listed: set[str] = set()
    known = {row.module for row in layers}
    for name, r in results.items():  # a forward origin names its module; the modules after it inherit
        o = r.origin if r.ran and not r.finite else None
        if o is not None and o.phase is Phase.FORWARD and o.module in known:
            origin_listed.add(name)
            order = next(row.order for row in layers if row.module == o.module)
            least.append((-math.inf, order, Ranked(precision=name, module=o.module, value=math.inf,
                                                   detail=f"output non-finite (origin: {o.op})")))
    for row in layers:
        for name, s in row.stats.items():
            if name == ref_name:
                continue
            if not s.out_finite:
                if name not in origin_listed:  # the first module whose output went non-finite; the rest inherit it
                    origin_listed.add(name)
                    least.append((-math.inf, row.order, Ranked(precision=name, module=row.module, value=math.inf,
                                                               detail="output non-finite")))
            else:
                errs = [v for v in (s.out_rel_err, s.param_grad_rel_err) if v is not None and math.isfinite(v)]
                if errs:
                    detail = f"outputs {_e(s.out_rel_err)}, param grads {_e(s.param_grad_rel_err)}"
                    least.append((-max(errs), row.order, Ranked(precision=name, module=row.module, value=max(errs),
                                                                detail=detail)))
            bits = s.headroom_bits
            if bits is not None:
                grad_side = s.grad_headroom_bits is not None and (s.out_headroom_bits is None
                                                                 or s.grad_headroom_bits < s.out_headroom_bits)
                would = s.grad_would_reach if grad_side else s.out_would_reach
                mag = would if would is not None else (s.grad_absmax if grad_side else s.out_absmax)
                detail = (f"{'gradient' if grad_side else 'activation'} |x| {_e(mag)}"
                          + (" (would reach)" if would is not None else "") + f", {_e(bits)} bits below its max")
                over.append((bits, row.order, Ranked(precision=name, module=row.module, value=bits, detail=detail)))
            share = s.underflow
            if share:
                detail = f"activations {_share(s.out_underflow)}, gradients {_share(s.grad_underflow)}"
                under.append((-share, row.order, Ranked(precision=name, module=row.module, value=share, detail=detail)))
    pick = lambda items: tuple(r for *_, r in sorted(items, key=lambda x: (x[0], x[1]))[:k])  # noqa: E731
    return pick(least), pick(over), pick(under)


def _e(x: float | None) -> str:
    return "-" if x is None else (str(x) if not math.isfinite(x) else f"{x:.3g}")


def _share(x: float | None) -> str:
    return "-" if x is None else _pct(x) if x else "0"


# -- recommendation ---------------------------------------------------------------------------------------

def _problem(r: PrecisionRun, bf16_ok: bool) -> tuple[str, str]:
    """(what went wrong, what to do) for a non-finite precision; bf16 is offered only where it is safe."""
    o = r.origin
    if o is None:
        return "non-finite loss or gradients", "keep fp32"
    where = o.module or ROOT
    op = o.node or o.op
    alt = " or use bf16" if bf16_ok and r.name != "bf16" else ""
    limit = _dtype_max(r.dtype) if r.dtype in ("float16", "bfloat16") else None
    if r.would_reach is not None and limit is not None and r.would_reach > limit:
        return (f"overflows in {where} at {op} (|x| would reach {_pow2(r.would_reach)} > {limit:g})",
                "keep that block in fp32" + alt)
    if r.underflow_origin or (r.zeros_at_origin and r.zeros_at_origin[0] > r.zeros_at_origin[1]):
        here, ref = r.zeros_at_origin
        share = f"{_pct(r.underflow_origin)} of its inputs are zero or subnormal in {r.name}" \
            if r.underflow_origin else f"{here} of its inputs are 0 in {r.name}, {ref} in the reference"
        if r.underflow_explains:
            share += f"; they feed {_pct(r.underflow_explains)} of its non-finite outputs"
        return (f"underflows before {op} in {where} ({share})",
                "compute that in fp32 or add an eps" + alt.replace(" or", ", or"))
    return f"non-finite ({o.kind}) at {op} in {where}", "keep that block in fp32" + alt


def _recommend(results: dict[str, PrecisionRun], ref_name: str, cfg: CompareConfig, entry: str,
               step: int, bad_input: list[str]) -> tuple[str | None, str]:
    ref = results[ref_name]
    if not ref.finite:
        what, _ = _problem(ref, False)
        if bad_input:
            what = f"the batch holds non-finite values at {', '.join(bad_input[:3])}"
        return None, (f"no precision fixes this step: it is non-finite even in {ref_name} ({what}); "
                      f"run `nanprobe run {entry} --at {step}` to find the cause")
    fp32 = results.get("fp32")
    # gradient underflow beyond what fp32 itself shows against fp64 (a saturated softmax zeroes some in fp32 too)
    base = (fp32.underflow_grads or 0.0) if fp32 is not None and fp32.ran and not fp32.reference else 0.0

    def excess(r: PrecisionRun) -> float:
        return (r.underflow_grads or 0.0) - base

    def accurate(r: PrecisionRun) -> bool:
        return (r.loss_rel_err is not None and r.loss_rel_err <= cfg.loss_tolerance
                and (r.grad_cosine is None or r.grad_cosine >= cfg.min_cosine))

    def safe(r: PrecisionRun | None) -> bool:
        return bool(r is not None and r.ran and r.finite and accurate(r) and r.supported is not False
                    and excess(r) < cfg.underflow_share)

    bf16_ok = safe(results.get("bf16"))
    parts: list[str] = []
    for name in ("bf16", "fp16", "fp16+scaler", "tf32", "fp32"):
        r = results.get(name)
        if r is None or not r.ran or name == ref_name:
            continue
        if r.supported is False:
            parts.append(f"{name}: not supported natively on this GPU")
        elif not r.finite:
            what, fix = _problem(r, bf16_ok)
            f16 = results.get("fp16")
            if name == "fp16+scaler" and f16 is not None and f16.ran and not f16.finite and f16.origin and r.origin \
                    and (f16.origin.phase, f16.origin.module, f16.origin.op) == (r.origin.phase, r.origin.module,
                                                                                r.origin.op):
                parts[-1] = parts[-1].replace("fp16: ", "fp16 (with or without GradScaler): ", 1)
                continue
            if r.scaler is not None and r.scaler.skipped and r.scaler.settled_scale is None and r.loss is not None \
                    and math.isfinite(r.loss):
                what = f"GradScaler skips this step at every scale down to {_pow2(r.scaler.scale * 0.5 ** r.scaler.halvings)}"
            parts.append(f"{name}: {what}: {fix}")
        else:
            text = f"{name}: finite, loss within {_pct(r.loss_rel_err or 0.0)} of {ref_name}"
            if r.grad_cosine is not None and r.grad_cosine < cfg.min_cosine:
                text += f", gradient cosine only {r.grad_cosine:.4f}"
            elif name in ("bf16", "fp16", "fp16+scaler") and r.grad_cosine is not None:
                text += f", gradient cosine {r.grad_cosine:.4f}"
            if excess(r) >= cfg.underflow_share:
                text += f", {_pct(r.underflow_grads)} of gradient values underflow" + (
                    f" ({_pct(base)} in fp32)" if base else "")
            if r.scaler is not None and r.scaler.skipped:
                o = r.scaler.overflow
                why = f" ({o.node or o.op} in {o.module or ROOT} overflows)" if o is not None else ""
                text += (f"; GradScaler skips this step at {_pow2(r.scaler.scale)}{why} and settles at "
                         f"{_pow2(r.scaler.settled_scale)}")
            if name in ("fp32", "tf32") and accurate(r):
                continue  # only worth a word when something is off
            parts.append(text)
    recommended = next((n for n in _PREFERENCE if n != ref_name and safe(results.get(n))), None)
    if recommended is None:
        recommended = "fp32" if (fp32 is not None and fp32.ran and fp32.finite) else None
    head = f"use {recommended}" if recommended else "no compared precision is safe for this step"
    return recommended, head + (" — " + "; ".join(parts) if parts else "")


# -- plot ------------------------------------------------------------------------------------------------

def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed", "--plot",
                         "Install it with: pip install 'nanprobe[plot]'") from None


_PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def plot_comparison(cmp: Comparison, path: str | Path) -> Path:
    """Per-layer abs-max of activations and gradients for each precision, log axis, fp16/bf16 limits."""
    path = Path(path)
    if path.suffix.lower() not in _PLOT_SUFFIXES:
        raise UsageError(f"cannot write a plot to {path}", "--plot",
                         f"Give a file ending in {', '.join(_PLOT_SUFFIXES)}")
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modules = [row.module for row in cmp.layers]
    fig = Figure(figsize=(max(8.0, min(0.28 * len(modules) + 4, 30.0)), 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True)
    limits = [(torch.finfo(torch.float16).max, "fp16 max", "tab:red", "--"),
              (torch.finfo(torch.float16).tiny, "fp16 smallest normal", "tab:red", ":"),
              (torch.finfo(torch.bfloat16).max, "bf16 max", "tab:purple", "--"),
              (torch.finfo(torch.bfloat16).tiny, "bf16 smallest normal", "tab:purple", ":")]
    for ax, attr, title in ((axes[0], "out_absmax", "activations: max |module output|"),
                            (axes[1], "grad_absmax", "gradients: max |d loss / d module output| (as held)")):
        lows: list[float] = []
        for name, run in cmp.precisions.items():
            if not run.ran:
                continue
            xs, ys, bad_x, bad_y = [], [], [], []
            for i, row in enumerate(cmp.layers):
                s = row.stats.get(name)
                if s is None:
                    continue
                v = getattr(s, attr)
                finite = s.out_finite if attr == "out_absmax" else s.grad_finite
                if v is not None and v > 0:
                    xs.append(i)
                    ys.append(v)
                if not finite:
                    bad_x.append(i)
                    would = s.out_would_reach if attr == "out_absmax" else s.grad_would_reach
                    bad_y.append(would or v or 1.0)
            style = dict(color="black", linewidth=2.5, alpha=0.35) if run.reference else dict(linewidth=1.2)
            line = ax.plot(xs, ys, marker="o", markersize=3, label=name + (" (reference)" if run.reference else ""),
                           **style)[0]
            lows.extend(ys)
            if bad_x:
                ax.scatter(bad_x, bad_y, marker="x", s=40, color=line.get_color(), label=f"{name} non-finite")
        for value, label, color, style in limits:
            ax.axhline(value, color=color, linestyle=style, linewidth=0.9, label=label)
        ax.set_yscale("log")
        floor = float(torch.finfo(torch.float32).smallest_normal) * 1e-3  # fp64-only magnitudes are off the chart
        ax.set_ylim(max(min(lows + [limits[3][0]]) / 10, floor), limits[2][0] * 100)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend(fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[1].set_xticks(range(len(modules)), modules, rotation=90, fontsize=6 if len(modules) > 30 else 7)
    fig.suptitle(f"nanprobe compare-precisions: {cmp.entry} step {cmp.step} (reference {cmp.reference})",
                 fontsize=10)
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}", "--plot", "Give a writable path") from None
    return path


__all__ = ["CHOICES", "Comparison", "LayerRow", "LayerStat", "PrecisionRun", "Ranked", "ScalerResult",
           "compare_precisions", "parse_precisions", "plot_comparison", "require_matplotlib"]
