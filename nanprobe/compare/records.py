"""compare-precisions records: the per-precision and per-layer results and their JSON."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from ..base.version import __version__
from ..base.errors import EXIT_FOUND, EXIT_OK, UsageError
from ..base.precision import Precision
from ..base.report import SCHEMA, Origin, _num

CHOICES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp16+scaler")
_RUNS = {name: (Precision(name.removesuffix("+scaler")), name.endswith("+scaler")) for name in CHOICES}  # +GradScaler
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
    "underflow.max": "the largest of the shares above; measured for fp16 and bf16 runs (fp32 and tf32 share "
                     "the reference's floor, float32's smallest normal, so nothing the reference holds can "
                     "underflow there: shown as null)",
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

def _fields_json(record) -> dict[str, Any]:
    """Every field, in declaration order; floats through ``_num``."""
    return {f.name: (_num(v) if isinstance(v := getattr(record, f.name), float) else v) for f in fields(record)}


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
        return min((v for v in (self.out_headroom_bits, self.grad_headroom_bits) if v is not None), default=None)

    @property
    def underflow(self) -> float | None:
        return max((v for v in (self.out_underflow, self.grad_underflow) if v is not None), default=None)

    def to_json(self) -> dict[str, Any]:
        return _fields_json(self)


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
        return _fields_json(self)


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
        return max((v for v in (self.underflow_grads, self.underflow_act_grads, self.underflow_acts,
                                self.underflow_origin) if v is not None), default=None)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ran": self.ran, "reference": self.reference, "dtype": self.dtype}
        if not self.ran:
            return {**out, "note": self.note}
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
        optional = {"zeros_at_origin": self.zeros_at_origin and dict(zip(("here", "reference"), self.zeros_at_origin)),
                    "underflow_explains": _num(self.underflow_explains),
                    "scaler": self.scaler and self.scaler.to_json(), "supported": self.supported, "note": self.note}
        return out | {k: v for k, v in optional.items() if v is not None}   # each only where known


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
    # precisions whose gradient disagrees with the reference's: {"precision", "grad_cosine", "evidence"}
    disagreements: tuple[dict[str, Any], ...] = ()

    @property
    def finite(self) -> bool:
        return all(r.finite for r in self.precisions.values() if r.ran)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.finite and not self.disagreements else EXIT_FOUND

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "nanprobe": __version__, "command": "compare-precisions", "entry": self.entry,
            "step": self.step, "status": "finite" if self.finite else "nonfinite", "device": self.device,
            "precision": self.precision, "reference": self.reference,
            "precisions": {k: v.to_json() for k, v in self.precisions.items()},
            "layers": {k: [r.to_json() for r in getattr(self, a)] for k, a in (
                ("modules", "layers"), ("least_accurate", "least_accurate"),
                ("closest_to_overflow", "closest_to_overflow"), ("deepest_underflow", "deepest_underflow"))},
            "recommendation": self.recommendation, "recommended": self.recommended,
            "disagreements": [dict(d) for d in self.disagreements],
            "notes": list(self.notes), "reached_by": self.reached_by, "autocast_policy": self.autocast_policy,
            "definitions": dict(DEFINITIONS),
        }
