"""Find the op that PRODUCED the first non-finite value, in forward, backward and update.

``OriginTracker`` is the public facade. It owns a private ``TorchDispatchMode`` that checks the
floating outputs of every op (a float32 sum is non-finite iff a value is; ``torch.aminmax`` then
tells NaN from ±Inf), and global module hooks that keep the module stack, label each autograd
node with the module that created it (a walk back from the module's outputs: exact, where
``ModuleTracker`` misattributes backward ops), and record per-module range statistics. The
forward source line of a backward origin comes from anomaly mode's node metadata in the one
rerun that needs it (``source_of_node``). Nothing here prints; everything is collected and the
hooks are removed on exit, errors included.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..base.batch import iter_tensors
from ..base.errors import _is_library_file, short_path, user_source_frame
from ..base.precision import Limits, limits
from ..base.report import ModuleRange, Phase

aten = torch.ops.aten

LOSS_FN = "(loss_fn)"   # ops outside any module of the model

# Ops whose output cannot hold a newly born non-finite value, or holds garbage by design.
_SKIP = {
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.detach.default,
    aten.lift_fresh.default, aten._local_scalar_dense.default, aten.set_.source_Storage,
    aten.zeros.default, aten.zeros_like.default, aten.ones_like.default, aten.ones.default,
    aten.zero_.default, aten.aminmax.default, aten.isfinite.default, aten.isnan.default,
    aten.isinf.default,
}

# Ops that cannot turn finite inputs into a non-finite output: they move, select, copy or mask
# values (a masked_fill with -inf is an intended mask: its -inf is an input). A non-finite value
# they pass on was produced by an earlier, checked op, so skipping them loses no origin.
_MOVERS = {
    aten.clone.default, aten._unsafe_view.default, aten.view.default, aten._reshape_alias.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor,
    aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
    aten.embedding.default, aten.index_select.default, aten.gather.default, aten.index.Tensor,
    aten.cat.default, aten.stack.default, aten.relu.default, aten.relu_.default, aten.threshold_backward.default,
    aten.copy.default,
    aten.select_backward.default, aten.slice_backward.default, aten.constant_pad_nd.default,
    aten.max_pool2d_with_indices.default, aten.repeat.default, aten.roll.default, aten.flip.default,
    aten.tril.default, aten.triu.default, aten.zero_.default, aten.fill_.Scalar,
}


def _narrowing_cast(args, out) -> bool:
    """Whether a dtype conversion can overflow: to a type whose range is smaller (fp32 -> fp16)."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return False
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if src is None or not src.is_floating_point():
        return True
    return torch.finfo(out.dtype).max < 0.99 * torch.finfo(src.dtype).max


_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout}
_UNCHECKED = _SKIP | _MOVERS | _CASTS   # one set lookup per op on the dispatch path

MAX_EVENTS = 12
_op_name = functools.cache(str)   # an op's name, e.g. "aten.mm.default"
# Reductions whose -inf output from -inf inputs means an empty set (every entry of the slice was
# -inf, e.g. an anchor with no positive): an origin, not an intended mask passing through.
_EMPTY_SET = {aten.logsumexp.default}


@dataclass(slots=True)
class TensorStats:
    """Numbers about one input of the origin op (for classification and evidence)."""

    dtype: str
    shape: tuple[int, ...]
    absmax: float
    min: float
    max: float
    min_nonzero: float | None
    zeros: int
    nonfinite: int
    numel: int


@dataclass(slots=True)
class Event:
    """One op that produced non-finite values from inputs without them."""

    index: int                 # position among all checked ops of the step
    phase: Phase
    module: str | None
    op: str
    node: str | None           # autograd node executing (backward)
    kind: str                  # nan | +inf | -inf | inf
    source: str | None
    code: str | None
    out_dtype: str
    out_nonfinite: int
    out_numel: int
    samples: tuple[int, ...]
    inputs: list[TensorStats]
    scalars: list[Any]
    occurrence: int            # k-th call of this op in this module and phase
    parameter: str | None = None
    update_info: dict[str, Any] | None = None
    masked: bool = False       # set later when the step's loss stayed finite
    node_seq: int | None = None  # backward: the node's creation order in the step (finds it again in a rerun)
    micro: int | None = None   # the micro-batch being processed (gradient accumulation)


@dataclass(slots=True)
class Failed:
    """The op that raised an exception (the user's code raised inside it)."""

    phase: Phase
    module: str | None
    op: str
    source: str | None
    code: str | None
    inputs: list[TensorStats]


@dataclass(slots=True)
class Probe:
    """What to record about one specific op call in a reference rerun."""

    phase: Phase
    module: str | None
    op: str
    occurrence: int
    node: str | None = None
    inputs: list[TensorStats] | None = None
    out_absmax: float | None = None
    found: bool = False


@dataclass(slots=True)
class Trace:
    events: list[Event] = field(default_factory=list)
    ranges: list[ModuleRange] = field(default_factory=list)
    range_op_index: list[int] = field(default_factory=list)
    ops_checked: int = 0
    probe: Probe | None = None
    node_source: tuple[str | None, str | None] | None = None  # (file:line, code) of a node found in a rerun
    flagged: set[int] = field(default_factory=set)   # deferred mode: ops whose output was non-finite
    reads: int = 0                                   # device-to-host reads the tracker made
    failed: Failed | None = None  # the op that raised, when the step raised inside an op
    # the first op with a non-finite output when its input was already non-finite and no op of the step made
    # it so: the value came from outside the ops checked (a NaN constant, a tensor the step did not compute)
    entered: Event | None = None


def _floats(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0]


# dtypes whose own sum (accumulated in float32 or wider by torch) overflows no sooner than a float32 one:
# summed as they are. A bfloat16 tensor summed with dtype=float32 is first copied to float32 (3x the time
# on CPU); float16 and the float8s would overflow their own narrow range, so they are summed in float32.
_OWN_SUM = frozenset({torch.float32, torch.float64, torch.bfloat16})


def _sum(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.sum() if t.dtype in _OWN_SUM else t.sum(dtype=torch.float32)


def _any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """One reduction per tensor and one sync. A sum (see _sum) is NaN/Inf if any value is; it can
    also overflow on its own (values near 3e38), so a True here is confirmed with aminmax."""
    if len(tensors) == 1:
        return not math.isfinite(_sum(tensors[0]).item())
    return not all(math.isfinite(v) for v in torch.stack([_sum(t).double() for t in tensors]).tolist())


def _kinds(tensors: list[torch.Tensor]) -> list[tuple[bool, bool, bool]]:
    """(has_nan, has_posinf, has_neginf) per tensor, with one device sync."""
    if not tensors:
        return []
    values = torch.stack([m.float() for t in tensors for m in torch.aminmax(t.detach())]).tolist()
    return [(math.isnan(mn) or math.isnan(mx), mx == math.inf, mn == -math.inf)
            for mn, mx in zip(values[0::2], values[1::2])]


def _tensor_stats(t: torch.Tensor) -> TensorStats:
    x = t.detach().float()
    finite = torch.isfinite(x)
    fx = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    ax = fx.abs()
    nz = torch.where(ax > 0, ax, torch.full((), math.inf, device=x.device))
    row = torch.stack([ax.max(), fx.min(), fx.max(), nz.min(), (x == 0).sum().float(),
                       (~finite).sum().float()]).tolist()
    return TensorStats(dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape), absmax=row[0], min=row[1],
                       max=row[2], min_nonzero=None if math.isinf(row[3]) else row[3], zeros=int(row[4]),
                       nonfinite=int(row[5]), numel=t.numel())


@functools.cache
def _written(func) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, keyword-only) of the arguments an op writes to."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors an in-place or out= op writes to (checked before the op overwrites them)."""
    return _floats([kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
                    for i, name, kwarg_only in _written(func)])


class _OriginMode(TorchDispatchMode):
    def __init__(self, tracker: OriginTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tracker
        if not tr.active:
            return func(*args, **kwargs)
        checked = not (func in _UNCHECKED or func.is_view)
        mutated = _mutated(func, args, kwargs) if checked and func._schema.is_mutable else []
        pre = None
        # checked one by one as it runs: the kinds of the tensors it writes, before the op overwrites them
        if mutated and not tr.deferred and (tr.only is None or tr.trace.ops_checked + 1 in tr.only):
            with torch._C.DisableTorchFunction():
                pre = _kinds(mutated)
                tr.trace.reads += 1
        try:
            out = func(*args, **kwargs)
        except Exception:   # where a step raises is always noted, checked op or not
            tr._failed(func, args, kwargs)
            raise
        if checked or func in _CASTS and _narrowing_cast(args, out):
            tr._check(func, args, kwargs, out, mutated, pre)
        return out


class OriginTracker:
    """Instrument one training step; read ``trace`` afterwards.

    Use as a context manager around the step and call ``set_phase`` at the boundaries
    (the step function in ``rerun`` does this).
    """

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer] | None, *,
                 low_dtype: torch.dtype | None, batch_size: int | None, probe: Probe | None = None,
                 source_of_node: int | None = None, phases: frozenset[Phase] | None = None, deferred: bool = False,
                 only: frozenset[int] | None = None):
        self.model = model
        # deferred: each checked op's finiteness stays on the device (a sum), read once per phase; the
        # ops found non-finite are then checked one by one in a second pass with ``only`` = their
        # indices (no device sync for the others). Without either: every op is checked as it runs.
        self.deferred = deferred
        self.only = only
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._bad_storages: set[int] = set()  # only-mode: outputs of flagged ops (their users propagate)
        # the phases whose ops are checked one by one (others run at full speed)
        self.phases = frozenset(phases) if phases is not None else frozenset(Phase)
        self.optimizers = list(optimizers or [])
        self.names = {id(m): name for name, m in model.named_modules()}
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.limits: Limits = limits(low_dtype or torch.float16)
        self.batch_size = batch_size
        self.trace = Trace(probe=probe)
        self.phase: Phase = Phase.FORWARD
        self.active = False
        self.stack: list[str] = []
        self.node_labels: dict[Any, str] = {}       # autograd node -> module that created it
        self.base_seq = 0                             # sequence number at the start of the step
        self._started = False
        self.micro: int | None = None                 # micro-batch in progress (accumulation)
        self._micros = 1
        self.source_of_node = source_of_node          # node_seq whose forward line to read (anomaly rerun)
        # (module, op index, dtype, [absmax, min_nonzero, zero_frac, over_frac, under_frac, nonfinite])
        self._module_stats: list[tuple[str, int, str, torch.Tensor]] = []
        # the last module outputs, by reference: their ranges are computed only for the modules
        # just before the origin (or the end of the forward), not for every module
        self._recent: deque[tuple[str, torch.Tensor, int]] = deque(maxlen=6)
        self._origin_module: str | None = None  # its range is taken when it finishes
        self._occurrences: dict[tuple, int] = {}
        self._storage_names: dict[int, tuple[str, str]] = {}
        self._handles: list[Any] = []
        self._modes: list[Any] = []

    # -- context -------------------------------------------------------------------------
    def __enter__(self) -> OriginTracker:
        mm = torch.nn.modules.module
        self._handles = [mm.register_module_forward_pre_hook(self._pre_hook),
                         mm.register_module_forward_hook(self._post_hook, always_call=True)]
        self._modes = [_OriginMode(self)]
        self._modes[0].__enter__()
        self.active = self.phase in self.phases
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._modes, self._handles = [], []
        self._flush_recent()
        self._flush_pending()
        self._finish_ranges()

    def _flush_pending(self) -> None:
        """Deferred mode: read the pending per-op sums in one go; note the ops that went non-finite."""
        if not self._pending:
            return
        values = torch.stack([v for _, v in self._pending]).tolist()
        self.trace.reads += 1
        self.trace.flagged.update(i for (i, _), v in zip(self._pending, values) if not math.isfinite(v))
        self._pending = []

    def set_phase(self, phase: Phase) -> None:
        if phase is Phase.FORWARD and not self._started:   # node numbers count from the step's start
            self._started = True
            self.active = False
            self.base_seq = _next_sequence_nr()
        elif phase is not Phase.FORWARD and self.phase is Phase.FORWARD:
            self._flush_recent()
        if phase is not self.phase:
            self._flush_pending()
        self.phase = phase
        self.active = phase in self.phases
        if phase is Phase.UPDATE and self.optimizers and self.active:   # name the tensors the update writes
            self._storage_names = names = {}
            for opt in self.optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        pname = self.param_names.get(id(p), "?")
                        names[p.untyped_storage().data_ptr()] = (pname, "param")
                        if p.grad is not None:
                            names[p.grad.untyped_storage().data_ptr()] = (pname, "grad")
                        for key, value in opt.state.get(p, {}).items():
                            if isinstance(value, torch.Tensor) and value.numel() > 1:
                                names[value.untyped_storage().data_ptr()] = (pname, key)

    def set_micro(self, j: int, batch_size: int | None, count: int) -> None:
        """The step moved on to micro-batch ``j`` (of ``count``) with ``batch_size`` samples."""
        self.micro = j
        self._micros = count
        self.batch_size = batch_size

    # -- module tracking -----------------------------------------------------------------
    def _pre_hook(self, module, args):
        name = self.names.get(id(module))
        if name is not None and self.phase is Phase.FORWARD:
            self.stack.append(name)

    def _post_hook(self, module, args, output):
        name = self.names.get(id(module))
        if name is None or self.phase is not Phase.FORWARD:
            return
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if Phase.BACKWARD in self.phases and torch.is_grad_enabled():
            self._label_nodes(name, output)
        if self.active:
            outs = [t for _, t in iter_tensors(output) if t.is_floating_point() and t.numel() > 0]
            if outs:
                if not self.trace.events:
                    self._recent.append((name, outs[0], self.trace.ops_checked))
                elif name == self._origin_module:
                    self._record_range(name, outs[0], self.trace.ops_checked)
                    self._origin_module = None

    def _label_nodes(self, name: str, output: Any) -> None:
        """Label the autograd nodes this module created: walk back from its outputs to labelled nodes.

        Post-hooks run innermost module first, so each node gets the innermost module that made it;
        nodes the loss_fn creates outside the model stay unlabelled and read as "(loss_fn)".
        """
        labels = self.node_labels
        todo = [t.grad_fn for _, t in iter_tensors(output) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in labels:
                continue
            labels[node] = name
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in labels and not hasattr(nxt, "variable"):
                    todo.append(nxt)

    def _flush_recent(self) -> None:
        """Compute the ranges of the remembered module outputs (at the origin, or the forward's end)."""
        for name, t, op_index in self._recent:
            self._record_range(name, t, op_index)
        self._recent.clear()

    @contextlib.contextmanager
    def _paused(self):
        """Our own ops (reductions, reads) are not the user's: unchecked, torch functions off."""
        was, self.active = self.active, False
        try:
            with torch._C.DisableTorchFunction():
                yield
        finally:
            self.active = was

    def _record_range(self, name: str, t: torch.Tensor, op_index: int) -> None:
        with self._paused(), torch.no_grad():
            a = t.detach().abs().float()
            finite = torch.isfinite(a)
            inf = torch.full((), math.inf, device=a.device)
            zero = (a == 0)
            stats = torch.stack([
                torch.where(finite, a, torch.zeros((), device=a.device)).max(),
                torch.where(zero | ~finite, inf, a).min(),
                zero.float().mean(),
                (finite & (a > self.limits.max)).float().mean(),
                (~zero & (a < self.limits.tiny)).float().mean(),
                (~finite).float().sum(),
            ])
        self._module_stats.append((name, op_index, str(t.dtype).replace("torch.", ""), stats))

    def _finish_ranges(self) -> None:
        if not self._module_stats:
            return
        rows = torch.stack([m[3].cpu() for m in self._module_stats]).tolist()
        self.trace.reads += 1
        for (name, op_index, dtype, _), row in zip(self._module_stats, rows):
            self.trace.ranges.append(ModuleRange(
                module=name, dtype=dtype, absmax=row[0], min_nonzero=None if math.isinf(row[1]) else row[1],
                zero_frac=row[2], over_frac=row[3], under_frac=row[4], finite=row[5] == 0))
            self.trace.range_op_index.append(op_index)
        self._module_stats = []

    # -- update phase --------------------------------------------------------------------
    def _update_context(self, tensors: list[torch.Tensor]) -> tuple[str | None, dict[str, Any] | None]:
        hit = next((h for t in tensors if (h := self._storage_names.get(t.untyped_storage().data_ptr()))), None)
        if hit is None:
            return None, None
        pname, role = hit
        info: dict[str, Any] = {"parameter": pname, "role": role}
        p = dict(self.model.named_parameters()).get(pname)
        opt, group = next(((o, g) for o in self.optimizers for g in o.param_groups
                           if any(q is p for q in g["params"])), (None, None))
        if opt is not None:
            info["lr"] = _scalar(group.get("lr"))
            info.update({k: _scalar(group[k]) for k in ("eps", "weight_decay") if k in group})
            state = opt.state.get(p, {})
            info["optimizer"] = type(opt).__name__
            for key in ("exp_avg_sq", "square_avg", "sum", "exp_inf", "exp_avg"):
                v = state.get(key)
                if isinstance(v, torch.Tensor) and v.numel():
                    vv = v.detach().float()
                    info.update({f"{key}_min": vv.min().item(), f"{key}_zeros": int((vv == 0).sum().item()),
                                 f"{key}_numel": v.numel()})
        return pname, info

    # -- the check -----------------------------------------------------------------------
    def _failed(self, func, args, kwargs) -> None:
        """Note the op that raised (the first one): where the user's step failed, and its inputs."""
        if self.trace.failed is not None:
            return
        with self._paused(), contextlib.suppress(Exception):   # best effort: the user's exception propagates
            file, line, code = user_source_frame() if self.phase is Phase.FORWARD else (None, None, None)
            self.trace.failed = Failed(phase=self.phase, module=self._module_for_op(), op=str(func),
                                       source=f"{file}:{line}" if file else None, code=code,
                                       inputs=[_tensor_stats(t) for t in _floats((args, kwargs))[:4]])

    def _check(self, func, args, kwargs, out, mutated, pre) -> None:
        outs = ([out] if out.is_floating_point() and out.numel() > 0 else []) if isinstance(out, torch.Tensor) \
            else _floats(out)
        outs = outs or mutated  # in-place foreach ops (the optimizers' _foreach_*_) return None
        if not outs:
            return
        with self._paused():
            self._check_outputs(func, args, kwargs, outs, mutated, pre)

    def _check_outputs(self, func, args, kwargs, outs, mutated, pre) -> None:
        trace = self.trace
        trace.ops_checked += 1
        module = self._module_for_op()
        op = _op_name(func)
        node = torch._C._current_autograd_node() if self.phase is Phase.BACKWARD else None
        node_name = node.name() if node is not None else None
        key = (self.phase, module, op, node_name)
        occ = self._occurrences.get(key, 0)
        self._occurrences[key] = occ + 1
        probe = trace.probe
        if probe is not None and not probe.found and probe.phase is self.phase and probe.module == module \
                and probe.op == op and probe.occurrence == occ and (probe.node is None or probe.node == node_name):
            probe.found = True
            probe.inputs = [_tensor_stats(t) for t in _floats((args, kwargs))]
            probe.out_absmax = max(_tensor_stats(t).absmax for t in outs)
            self.trace.reads += 2
        if len(trace.events) >= MAX_EVENTS:
            return
        if self.deferred:
            total = _sum(outs[0]).double()   # one kernel per output, no add of a 0 start
            for t in outs[1:]:
                total = total + _sum(t).double().to(total.device)
            self._pending.append((trace.ops_checked, total))
            return
        if self.only is not None:
            if trace.ops_checked not in self.only:
                return
            ins = _floats((args, kwargs))
            propagated = any(t.untyped_storage().data_ptr() in self._bad_storages for t in ins
                             if not any(t is m for m in mutated))
            self._bad_storages.update(t.untyped_storage().data_ptr() for t in outs)
            if propagated:
                return   # fed by an op already found non-finite: a propagator (no sync spent on it)
        else:
            self.trace.reads += 1
            if not _any_nonfinite(outs):
                return
        self.trace.reads += 4   # the kinds of outputs and inputs, the count, the samples
        out_kinds = _kinds(outs)
        if not any(any(k) for k in out_kinds):
            return  # the sum overflowed, the values are finite
        inputs = [t for t in _floats((args, kwargs)) if not any(t is m for m in mutated)]
        in_kinds = _kinds(inputs) + (pre or [])
        scalars = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, (int, float)) and not isinstance(a, bool)]
        in_nan = any(k[0] for k in in_kinds) or any(isinstance(s, float) and math.isnan(s) for s in scalars)
        in_inf = any(k[1] or k[2] for k in in_kinds) or any(isinstance(s, float) and math.isinf(s) for s in scalars)
        out_nan, out_pos, out_neg = (any(col) for col in zip(*out_kinds))
        born_nan = out_nan and not in_nan
        born_inf = (out_pos or out_neg) and not (in_inf or in_nan)
        if not (born_nan or born_inf) and func in _EMPTY_SET and out_neg and not out_nan and not in_nan \
                and not any(k[1] for k in in_kinds):
            born_inf = True   # -inf = log(sum of nothing): a slice of -inf only, an empty set
        entered = not (born_nan or born_inf)
        if entered and (trace.events or trace.entered is not None):
            return
        if entered and not out_nan and not out_pos and not any(k[0] or k[1] for k in in_kinds):
            # -inf from a Python scalar (scalar_tensor(-inf), full(..., -inf)) or passed on from a -inf input (a
            # causal mask added to the scores): an intended mask, never an origin
            return

        # the kind of the first output with a non-finite value (an op's scratch outputs, e.g. ctc_loss's
        # uninitialised log_alpha, must not decide it)
        bad_out, (b_nan, b_pos, b_neg) = next((t, k) for t, k in zip(outs, out_kinds) if any(k))
        kind = "nan" if (born_nan or entered) and b_nan else ("inf" if b_pos and b_neg else ("+inf" if b_pos else
                                                 "-inf" if b_neg else "nan"))
        nonfinite = int((~torch.isfinite(bad_out)).sum().item())
        samples: tuple[int, ...] = ()
        if self.phase is Phase.FORWARD and self.batch_size and bad_out.dim() >= 1 \
                and bad_out.shape[0] == self.batch_size:
            # a NaN born next to intended -inf (a masked softmax) names the rows with the NaN
            rows = (torch.isnan(bad_out.detach()) if kind == "nan" else ~torch.isfinite(bad_out.detach())) \
                .reshape(bad_out.shape[0], -1).any(1)
            samples = tuple(int(i) for i in rows.nonzero().flatten()[:8].tolist())
        source = code = None
        parameter = update_info = node_seq = None
        if self.phase is Phase.FORWARD:
            file, line, code = user_source_frame()
            source = f"{file}:{line}" if file else None
        elif self.phase is Phase.BACKWARD:
            node_seq = node._sequence_nr() - self.base_seq if node is not None else None
        elif self.phase is Phase.UPDATE:
            # a foreach or fused op updates many parameters: the one named is the one whose tensor went
            # non-finite (its index i in the op's tensor lists), not the list's first: first the i-th tensor of
            # every tensor list among the op's arguments (its parameter, gradient and optimizer state)
            lists = [list(a) for a in tree_flatten((args, kwargs), is_leaf=_is_tensor_list)[0] if _is_tensor_list(a)]
            # its index in the first list that holds it, and that list's length
            i, n = next(((k, len(lst)) for lst in [outs, *lists] for k, t in enumerate(lst) if t is bad_out),
                        (None, None))
            same = [lst[i] for lst in lists if len(lst) == n and lst[i] is not bad_out] if i is not None else []
            parameter, update_info = self._update_context([bad_out, *same, *mutated, *outs, *inputs])
            if parameter is None and i is not None:
                # a foreach op over temporaries (a denominator list): the parameter at that position, where
                # exactly one param group has that many parameters with a gradient (the lists a foreach step walks)
                fits = [g for g in ([p for p in g["params"] if p.grad is not None] for o in self.optimizers
                                    for g in o.param_groups) if len(g) == n]
                if len(fits) == 1:
                    parameter, update_info = self._update_context([fits[0][i]])
            if parameter is not None:
                module = parameter.rpartition(".")[0]
        if self.phase is Phase.FORWARD and not entered and not any(ev.phase is Phase.FORWARD for ev in trace.events):
            self._flush_recent()          # the modules just before the origin, as they are now
            self._origin_module = module  # and the origin's own module when it finishes
        event = Event(
            index=trace.ops_checked, phase=self.phase, module=module, op=op, node=node_name, kind=kind,
            source=source, code=code, out_dtype=str(bad_out.dtype).replace("torch.", ""),
            out_nonfinite=nonfinite, out_numel=bad_out.numel(), samples=samples,
            inputs=[_tensor_stats(t) for t in inputs + mutated],
            scalars=[_scalar(s) for s in scalars[:6]], occurrence=occ,
            parameter=parameter, update_info=update_info, node_seq=node_seq,
            micro=self.micro if self._micros > 1 else None)
        if entered:
            trace.entered = event
        else:
            trace.events.append(event)

    def _module_for_op(self) -> str | None:
        if self.phase is Phase.FORWARD:
            return self.stack[-1] if self.stack else LOSS_FN
        node = torch._C._current_autograd_node() if self.phase is Phase.BACKWARD else None
        if node is None:
            return None
        if self.source_of_node is not None and self.trace.node_source is None \
                and node._sequence_nr() - self.base_seq == self.source_of_node:
            self.trace.node_source = _anomaly_source(node)
        label = self.node_labels.get(node)
        if label is not None:
            return label
        if node.name() == "torch::autograd::AccumulateGrad":
            pname = self.param_names.get(id(getattr(node, "variable", None)))
            return pname.rpartition(".")[0] if pname else None
        return LOSS_FN  # created outside the model's modules


def _is_tensor_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, torch.Tensor) for t in x)


def _next_sequence_nr() -> int:
    """The autograd sequence number the next node will get (creates one throwaway node)."""
    with torch.enable_grad():
        probe = torch.zeros((), requires_grad=True).neg()
    return probe.grad_fn._sequence_nr() + 1


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _anomaly_source(node: Any) -> tuple[str | None, str | None]:
    """The innermost user frame of the forward stack anomaly mode recorded for a node."""
    frames = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    for frame in reversed(frames or []):
        m = _FRAME.search(frame)
        if m and not _is_library_file(m.group("file")):
            lines = frame.strip().splitlines()
            return f"{short_path(m.group('file'))}:{m.group('line')}", (lines[1].strip() if len(lines) > 1 else None)
    return None, None


def _scalar(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else None
    return x
