"""Report / Finding / Fix / Origin records and the JSON schema (schema 1).

Records hold numbers and names, never tensors. Only ``to_json`` knows the schema.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from .version import __version__
from .errors import EXIT_FOUND, EXIT_OK, EXIT_USAGE

SCHEMA = 1


class Cause(str, Enum):
    DATA = "data"
    OVERFLOW = "overflow"
    UNDERFLOW = "underflow"
    LOG = "log"
    SQRT = "sqrt"
    DIV = "div"
    DOMAIN = "domain"
    LR_SPIKE = "lr_spike"
    NOT_REPRODUCED = "not_reproduced"
    UNKNOWN = "unknown"          # a bad step nothing classified: low confidence, the raw facts as evidence


class Mechanism(str, Enum):
    """The slow process behind a failure (a finding's ``mechanism``); the cause code stays one of ``Cause``."""

    ATTENTION_LOGIT_GROWTH = "attention_logit_growth"
    OUTPUT_LOGIT_DIVERGENCE = "output_logit_divergence"
    ADAM_SECOND_MOMENT = "adam_second_moment"
    LR_SCHEDULE = "lr_schedule"
    LOSS_SCALE_COLLAPSE = "loss_scale_collapse"
    ACTIVATION_GROWTH = "activation_growth"


class Phase(str, Enum):
    INPUT = "input"
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


class Status(str, Enum):
    NONFINITE = "nonfinite"
    SPIKE = "spike"
    DIVERGING = "diverging"      # the loss left its own best level and did not come back
    FINITE = "finite"
    ERROR = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """The op that produced the first non-finite value from finite inputs."""

    phase: Phase
    module: str | None           # qualified module name; "(loss_fn)" outside the model
    op: str | None               # "aten.mm.default", or the autograd node for backward
    precision: str
    source: str | None = None    # "model.py:42"
    code: str | None = None      # the source line's text
    node: str | None = None      # autograd node, e.g. "SqrtBackward0" (backward origins)
    kind: str | None = None      # "nan" | "+inf" | "-inf" | "inf"
    samples: tuple[int, ...] = ()  # batch rows that carry the first non-finite values
    key: str | None = None       # batch key path for input origins
    parameter: str | None = None  # update origins: the parameter that blew up
    micro: int | None = None     # the micro-batch being processed (gradient accumulation)

    def to_json(self) -> dict[str, Any]:
        return _with({"phase": self.phase.value, "module": self.module, "op": self.op, "precision": self.precision,
                      "source": self.source}, code=self.code, node=self.node, kind=self.kind, key=self.key,
                     parameter=self.parameter, micro=self.micro, samples=list(self.samples) or None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fix:
    title: str
    code: str
    why: str = ""
    verified: bool | None = None   # True: held over the horizon; False: failed; None: not checked
    verify_note: str | None = None
    # how it was checked: {"horizon": H, "from_step": s, "held": bool, "failed_at": k | None,
    # "loss_fixed": x, "loss_unfixed": y, "new_origin": {...} | None, ...}
    verification: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return _with({"title": self.title, "code": self.code, "verified": self.verified}, why=self.why or None,
                     verify_note=self.verify_note or None, verification=self.verification)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    cause: Cause
    confidence: float            # 0..1, the ranking key
    phase: Phase
    module: str | None
    op: str | None
    evidence: tuple[str, ...]
    fixes: tuple[Fix, ...] = ()
    mechanism: Mechanism | None = None   # the slow process behind the cause, where one was seen
    onset: int | None = None             # the step where it (or a recovered excursion before it) began

    def to_json(self) -> dict[str, Any]:
        return _with({"cause": self.cause.value, "confidence": round(self.confidence, 3), "phase": self.phase.value,
                      "module": self.module, "op": self.op, "evidence": list(self.evidence),
                      "fixes": [f.to_json() for f in self.fixes]},
                     mechanism=self.mechanism.value if self.mechanism is not None else None, onset=self.onset)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionResult:
    precision: str
    loss: float | None
    finite: bool
    origin: Origin | None = None
    grad_norm: float | None = None
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _with({"loss": _num(self.loss), "finite": self.finite,
                      "origin": self.origin.to_json() if self.origin else None},
                     grad_norm=_num(self.grad_norm), note=self.note or None)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleRange:
    """Range statistics of one module's output in one rerun."""

    module: str
    dtype: str
    absmax: float
    min_nonzero: float | None
    zero_frac: float
    over_frac: float      # share of |x| above the low-precision max (would be inf in fp16)
    under_frac: float     # share of non-zero |x| below the smallest normal of the low precision
    finite: bool

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "dtype": self.dtype, "absmax": _num(self.absmax),
                "min_nonzero": _num(self.min_nonzero), "zero_frac": _num(self.zero_frac),
                "over_frac": _num(self.over_frac), "under_frac": _num(self.under_frac), "finite": self.finite}


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One replayed step: what the cheap per-step check saw."""

    step: int
    loss: float | None
    grad_norm: float | None
    lr: float | None
    update_ratio: float | None   # global |dw| / |w| over all parameters
    finite: bool
    skipped: bool = False        # GradScaler skipped the update
    scale: float | None = None
    epoch: int | None = None     # the epoch the step belongs to (None: callable batches)
    index: int | None = None     # the step's position within its epoch
    losses: dict[str, float] = field(default_factory=dict)  # per micro-batch or per loss the step returned

    def to_json(self) -> dict[str, Any]:
        out = {"step": self.step, "loss": _num(self.loss), "grad_norm": _num(self.grad_norm),
               "lr": _num(self.lr), "update_ratio": _num(self.update_ratio), "finite": self.finite,
               "skipped": self.skipped, "scale": _num(self.scale)}
        if self.epoch is not None:
            out["epoch"], out["index"] = self.epoch, self.index
        if self.losses:
            out["losses"] = {k: _num(v) for k, v in self.losses.items()}
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Fidelity:
    """Does the rerun reproduce the step the replay (or the guarded run) saw?"""

    reproduced: bool | None          # None: nothing comparable
    tolerance: str                   # "bitwise" (CPU) or "rtol 0.001" (CUDA)
    replayed: dict[str, Any]         # {"loss": ..., "grad_norm": ..., "raised": ...} of the replayed step
    reruns: tuple[dict[str, Any], ...] = ()   # each comparable rerun: {"rerun": ..., "loss", "grad_norm", "match"}
    reasons: tuple[str, ...] = ()    # likely reasons when not reproduced

    def to_json(self) -> dict[str, Any]:
        def clean(d: dict[str, Any]) -> dict[str, Any]:
            return {k: (_num(v) if isinstance(v, float) else v) for k, v in d.items()}
        return {"reproduced": self.reproduced, "tolerance": self.tolerance, "replayed": clean(self.replayed),
                "reruns": [clean(r) for r in self.reruns], "reasons": list(self.reasons)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    command: str
    entry: str
    step: int | None
    status: Status
    device: str
    precision: str
    origin: Origin | None = None
    findings: tuple[Finding, ...] = ()
    precisions: dict[str, PrecisionResult] = field(default_factory=dict)
    context: tuple[ModuleRange, ...] = ()   # the last modules before the origin, with their ranges
    history: tuple[StepRecord, ...] = ()
    notes: tuple[str, ...] = ()
    autocast_policy: str | None = None
    reached_by: str | None = None            # "replay from step 0", "load_state(...)", "capsule ..."
    position: dict[str, Any] | None = None   # {"epoch", "index", "items", "micro_batches"} of the step
    fidelity: Fidelity | None = None
    error: str | None = None                 # the user's code raised in this step: the one-line message
    # {"onset": step | None, "series": {"<module>/<stat>": [[step, value], ...]}, "warnings": [...]}
    trajectory: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return {Status.FINITE: EXIT_OK, Status.NONFINITE: EXIT_FOUND, Status.SPIKE: EXIT_FOUND,
                Status.DIVERGING: EXIT_FOUND, Status.ERROR: EXIT_USAGE}[self.status]

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def to_json(self) -> dict[str, Any]:
        out = {
            "schema": SCHEMA, "nanprobe": __version__, "command": self.command, "entry": self.entry,
            "step": self.step, "status": self.status.value, "device": self.device, "precision": self.precision,
            "origin": self.origin.to_json() if self.origin else None,
            "findings": [f.to_json() for f in self.findings],
            "precisions": {k: v.to_json() for k, v in self.precisions.items()},
            "context": [m.to_json() for m in self.context],
            "history": [h.to_json() for h in self.history],
            "notes": list(self.notes),
            "autocast_policy": self.autocast_policy,
            "reached_by": self.reached_by,
            "position": self.position,
            "fidelity": self.fidelity.to_json() if self.fidelity else None,
        }
        return {**_with(out, error=self.error or None, trajectory=self.trajectory), **self.extra}

    def dumps(self) -> str:
        return dumps(self.to_json())


def _with(out: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """``out`` plus the optional keys that are not None (a schema's optional fields)."""
    return {**out, **{k: v for k, v in optional.items() if v is not None}}


def _num(x: float | None) -> float | str | None:
    """JSON has no NaN/Inf: write them as strings so the file stays valid JSON."""
    if x is None or math.isfinite(x := float(x)):
        return x
    return "nan" if math.isnan(x) else "inf" if x > 0 else "-inf"


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, allow_nan=False, default=str)


def write_new(folder: Path, stem: str, data: dict[str, Any]) -> Path | None:
    """``data`` as JSON in a new file ``folder/stem.json`` (``stem-1.json``, ... when taken: never
    overwrites a report); None when it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for attempt in range(1000):
            path = folder / (f"{stem}.json" if not attempt else f"{stem}-{attempt}.json")
            try:
                with open(path, "x") as fh:
                    fh.write(dumps(data) + "\n")
                return path
            except FileExistsError:
                continue
    except OSError:
        return None
    return None
