"""compare-precisions measuring: module outputs, output gradients and parameter gradients of one rerun,
compared elementwise with the reference; the probes at a non-finite origin."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..base.batch import iter_tensors
from ..locate.instrument import LOSS_FN, _floats
from ..base.report import Phase
from ..locate.rerun import StepTrace

# -- capture: module outputs, their gradients and the parameter gradients of one rerun -----------------

ROOT = "(model)"
# "non-zero in the reference" means |ref| >= float32's smallest normal: an fp64 reference holds values
# (e.g. exp(-700) in a saturated softmax) that no training precision keeps, and they weigh nothing.
_FLOOR = float(torch.finfo(torch.float32).tiny)
# per-row numbers: absmax (finite), non-finite count, sum (y-ref)^2, sum ref^2, underflowed, ref non-zero, dot, sum y^2


@contextlib.contextmanager
def _quiet(device_type: str):
    """Our own measuring ops: no autograd, no autocast, invisible to the OriginTracker's modes."""
    with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes(), \
            torch.autocast(device_type, enabled=False):
        yield


@dataclass(slots=True)
class _Store:
    """What the reference run keeps for the elementwise comparisons (outputs as float32; the
    parameter gradients in a TensorStore: a file for large CPU models)."""

    budget: int                                           # bytes for outputs and gradient masks
    storage: Any                                          # nanprobe.reach.state.StoragePolicy for grad_store
    used: int = 0
    outputs: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    grad_masks: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # |ref grad| >= floor
    ref2: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)        # sum ref^2 of each output
    grads: dict[str, Any] = field(default_factory=dict)                            # name -> Slot (float32)
    grad_store: Any = None

    def fits(self, t: torch.Tensor, itemsize: int) -> bool:
        """Whether ``t``, at ``itemsize`` bytes an element, fits in what is left of the budget (then counted)."""
        fits = self.used + t.numel() * itemsize <= self.budget
        self.used += t.numel() * itemsize if fits else 0
        return fits


@dataclass(slots=True)
class _Row:
    kind: str            # out | grad | param
    module: str
    unique: bool         # first time this tensor is counted (a Sequential's output is its last child's)
    dtype: str
    compared: bool
    values: torch.Tensor


# max |x| and min |x| (torch.linalg.vector_norm's ord=inf and ord=-inf, NaN where x has a NaN) from one
# aminmax pass: the inf norms are an unvectorized reduction on CPU, 10-20x slower than aminmax, and
# x.abs() is a temporary the size of x


def _absmax(t: torch.Tensor) -> torch.Tensor:
    """max |x| as a tensor of t's dtype (no device sync)."""
    mn, mx = torch.aminmax(t)
    return torch.maximum(mx, mn.neg()).abs()   # abs: never -0.0


def _absmin(t: torch.Tensor) -> float:
    """min |x| (one device sync; the |x| pass only where t has values of both signs)."""
    mn, mx = (float(v) for v in torch.aminmax(t))
    if mn >= 0:
        return mn + 0.0   # never -0.0
    if mx <= 0:
        return -mx + 0.0
    return float(t.abs().amin())


def _underflow(t: torch.Tensor, ref: torch.Tensor | None, ref_mask: torch.Tensor | None, tiny: float,
               through: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements zero or below ``tiny`` in ``t`` where the reference is >= the float32 floor,
    elements >= the floor in the reference), as float64 scalars. Two cheap passes (min |x|, no
    temporaries) decide the common case of nothing small; the masks are built only otherwise."""
    if ref_mask is None and t.device.type == "cpu":
        if _absmin(ref) >= _FLOOR and _absmin(t) >= tiny:
            return torch.zeros((), dtype=torch.float64), torch.tensor(float(ref.numel()), dtype=torch.float64)
    nz = ref_mask if ref_mask is not None else ref.abs() >= _FLOOR
    a = t.abs()
    small = a < tiny if through is None else (a == 0) | ((a < tiny) & (t.to(through).to(t.dtype) == t))
    return (nz & small).sum().double(), nz.sum().double()


class _Capture:
    def __init__(self, model: torch.nn.Module, store: _Store, *, reference: bool, low: torch.dtype, scale: float,
                 device_type: str):
        self.names = {id(m): (name or ROOT) for name, m in model.named_modules()}
        self.params = list(model.named_parameters())
        self.store, self.reference, self.low, self.scale = store, reference, low, scale
        self.narrow = low in (torch.float16, torch.bfloat16)   # underflow is measured in fp16 and bf16 runs
        self.device_type = device_type
        self.phase: Phase | None = None
        self.calls: dict[str, int] = {}        # module -> calls so far, in the order of their first call
        self.rows: list[_Row] = []
        self._alive: dict[int, torch.Tensor] = {}
        self._ref_by_id: dict[int, torch.Tensor] = {}
        self._measured: set[str] = set()      # parameters whose gradient is measured (once per run)
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

    def _stats(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Largest finite |x| and the count of non-finite values, as float64 scalars.

        One pass (an infinity norm) when the tensor is finite; the masked passes only when it is not
        (on CPU, where reading the answer costs nothing; on CUDA always, to stay free of syncs)."""
        if t.device.type == "cpu":
            m = _absmax(t)
            if math.isfinite(float(m)):
                return m.double(), torch.zeros((), dtype=torch.float64)
        a = t.abs()
        finite = torch.isfinite(a)
        return torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device)).amax().double(), \
            (~finite).sum().double()

    def _tensor(self, kind: str, key: tuple[str, int], t: torch.Tensor, unique: bool, ident: int | None) -> None:
        absmax, nonfinite = self._stats(t)
        nought = torch.zeros((), dtype=torch.float64, device=t.device)
        diff2 = ref2 = under = count = nought
        store = self.store
        ref = None if self.reference else (store.outputs if kind == "out" else store.grad_masks).get(key)
        compared = self.reference or (ref is not None and ref.shape == t.shape)
        if self.reference:
            if kind == "out":
                kept = self._ref_by_id.get(ident)
                if kept is None and store.fits(t, 4):
                    kept = self._ref_by_id[ident] = t.to(torch.float32, copy=True)
                if kept is not None:
                    store.outputs[key] = kept
                ref2 = store.ref2[key] = torch.linalg.vector_norm(t, dtype=torch.float64).square()
            elif store.fits(t, 1):
                store.grad_masks[key] = t.abs() >= _FLOOR
        elif compared:
            if kind == "out":
                diff2 = torch.linalg.vector_norm(t.float() - ref, dtype=torch.float64).square()
                ref2 = store.ref2.get(key, nought)
            if self.narrow:   # zero or subnormal in its own dtype where the reference is not
                under, count = _underflow(t, ref if kind == "out" else None, None if kind == "out" else ref,
                                          torch.finfo(t.dtype).tiny)
        self._row(kind, key[0], unique, t, compared, [absmax, nonfinite, diff2, ref2, under, count, nought, nought])

    def _row(self, kind: str, module: str, unique: bool, t: torch.Tensor, compared: bool, values: list) -> None:
        self.rows.append(_Row(kind=kind, module=module, unique=unique, dtype=str(t.dtype).replace("torch.", ""),
                              compared=compared, values=torch.stack(values)))

    def _param_grads(self) -> None:
        named = [(name, p.grad.detach()) for name, p in self.params
                 if p.grad is not None and name not in self._measured]
        if not named:
            return
        self._measured.update(name for name, _ in named)
        grads = [g for _, g in named]
        norms = torch._foreach_norm(grads)                       # fused: |g| of every gradient
        tiny = torch.finfo(self.low).tiny
        store = self.store
        nought = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        if self.reference:
            if store.grad_store is None:
                store.grad_store = store.storage.new_store(grads[0].device.type, sum(g.numel() * 4 for g in grads))
            slots = store.grad_store.put_all([g.float() if g.dtype != torch.float32 else g for g in grads])
            store.grads.update({name: slot for (name, _), slot in zip(named, slots)})
        scratch: dict[tuple, torch.Tensor] = {}
        for (name, g), n2 in zip(named, norms):
            module = name.rpartition(".")[0] or ROOT
            absmax, nonfinite = self._stats(g)
            slot = None if self.reference else store.grads.get(name)
            compared = self.reference or (slot is not None and slot.shape == g.shape)
            if self.reference:
                r2 = n2.double().square()
                row = [absmax, nonfinite, nought, r2, nought, nought, r2, r2]
            elif not compared:
                row = [absmax, nonfinite] + [nought] * 6
            else:
                if (key := (g.device, g.numel())) not in scratch:
                    scratch[key] = torch.empty(g.numel(), dtype=torch.float32, device=g.device)
                r = scratch[key].view(g.shape)
                slot.copy_into(r)                       # the reference gradient (float32)
                gu = g.float() if self.scale == 1.0 else g.float() / self.scale
                r2 = torch.linalg.vector_norm(r, dtype=torch.float64).square()
                dot = torch.dot(gu.reshape(-1), r.reshape(-1)).double()
                sq = (n2.double() / self.scale).square()
                # an fp32 gradient of an fp16 run underflowed where it is 0, or subnormal in fp16 and
                # exactly representable there (it came through fp16); elsewhere: 0 or subnormal in its dtype
                under = count = nought
                if self.narrow:
                    under, count = _underflow(g, r, None, tiny, through=self.low if g.dtype != self.low else None)
                r.sub_(gu)
                diff2 = torch.linalg.vector_norm(r, dtype=torch.float64).square()
                row = [absmax, nonfinite, diff2, r2, under, count, dot, sq]
            self._row("param", module, True, g, compared, row)

    def finish(self) -> _Measured:
        values: list[list[float]] = []
        if self.rows:
            try:  # one device sync for the whole run
                values = torch.stack([r.values for r in self.rows]).tolist()
            except RuntimeError:  # rows on several devices (a model split across GPUs)
                values = torch.stack([r.values.cpu() for r in self.rows]).tolist()
        return _Measured.build(self.rows, values, list(self.calls))


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
            for i, name in enumerate(("diff2", "ref2", "under", "count", "dot", "sq"), start=2):
                setattr(self, name, getattr(self, name) + v[i])
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

    would_reach: float | None = None    # the reference's largest |output| of that op
    zeros: tuple[int, int] | None = None  # zeros among its inputs: here, in the reference
    underflow: float | None = None      # input elements >= floor in the reference, zero/subnormal here
    explains: float | None = None       # share of its non-finite outputs whose input underflowed


def _input_underflow(here: _OpProbe, ref: _OpProbe) -> _OriginProbe:
    zeros_here = zeros_ref = under = count = 0
    bad = here.out_bad
    hit = torch.zeros_like(bad) if bad is not None else None
    for x, r in zip(here.inputs, ref.inputs):
        if x.shape != r.shape:
            continue
        nz = r.abs() >= _FLOOR
        tiny = torch.finfo(x.dtype).tiny
        # underflow: a reference value below the low dtype's normal range, flushed here; a reference value
        # within the range that is 0 here was rounded away (cancellation), not flushed
        flushed = nz & (r.abs() < tiny) & (x.abs() < tiny)
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


def _bits(dtype_name: str | None, absmax: float | None) -> float | None:
    """Headroom in bits: log2(the dtype's max / absmax)."""
    limit = _dtype_max(dtype_name)
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
