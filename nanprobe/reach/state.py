"""The training state nanprobe captures and puts back exactly.

A :class:`Snapshot` holds everything one training step reads besides its batch: parameters and
buffers (non-persistent ones too), every optimizer, LR scheduler and GradScaler, the RNG streams
(torch, CUDA, Python ``random``, numpy), the thread count, each module's train/eval flag, tensors
kept as plain module attributes (an RNN's ``self.hidden``), and what the user's step function
keeps between calls (closure variables such as a carried hidden state or a step counter; the
attributes of the object a bound method belongs to). Restoring writes values back into the
user's own objects, in place where the layout allows: the identity of parameters, optimizer
state tensors and ``param_groups`` dicts never changes.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import types
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state
from torch.utils._pytree import tree_leaves, tree_map_only, tree_structure, tree_unflatten

from ..base.precision import device_of
from .store import Slot, TensorStore

# -- RNG streams --------------------------------------------------------------------------------------

HOST_PROBES_AT_START = 3   # first steps on which Python/numpy RNG use is probed
HOST_PROBE_EVERY = 100     # ... and then every this many steps


def capture_rng(device_type: str, *, host: bool = True) -> dict[str, Any]:
    """The RNG states now: torch (and every CUDA device when the run is on CUDA); Python's
    ``random`` and numpy's global state with ``host`` (they cost ~10 and ~60 us; torch's ~1 us)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device_type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if host:
        state["python"] = random.getstate()
        np = sys.modules.get("numpy")
        if np is not None:
            state["numpy"] = np.random.get_state()
    return state


def set_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` took (streams it did not take are left alone)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


def same_host_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.get("python") != b.get("python"):
        return False
    x, y = a.get("numpy"), b.get("numpy")
    if x is None or y is None:
        return x is y
    return x[0] == y[0] and x[2:] == y[2:] and bool((x[1] == y[1]).all())


class RngTracker:
    """Which RNG streams are worth copying at each capture point.

    torch's (and CUDA's) state is always copied. Python's and numpy's are copied on probe steps
    (the first few, then every 100th); once a probe sees a step change them, on every step.
    Where they were not copied, their state at any later moment of the step equals the state at
    its start, because nothing drew from them.
    """

    def __init__(self, device_type: str, mode: str = "auto"):
        self.device_type = device_type
        self.mode = mode
        self.host_used = mode == "all"
        self._steps = 0
        self._probe_start: dict[str, Any] | None = None

    def begin_step(self) -> None:
        probing = self.mode == "auto" and not self.host_used and (
            self._steps < HOST_PROBES_AT_START or self._steps % HOST_PROBE_EVERY == 0)
        self._probe_start = capture_rng("cpu", host=True) if probing else None
        self._steps += 1

    def end_step(self) -> None:
        if self._probe_start is not None and not same_host_rng(self._probe_start, capture_rng("cpu", host=True)):
            self.host_used = True
        self._probe_start = None

    def capture(self) -> dict[str, Any]:
        return capture_rng(self.device_type, host=self.host_used or self._probe_start is not None)


# -- state kept outside parameters, buffers and optimizers --------------------------------------------

_NOT_STATE = object()
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))   # training, _parameters, the hook dicts, ...


def _value(v: Any, depth: int = 0) -> Any:
    """A restorable copy of a value a step keeps between calls, or _NOT_STATE.

    Tensors are kept by reference with their version counter: steps rebind carried state
    (``hidden = hidden.detach()``), which a reference restores; an in-place change shows in the
    version counter and is reported instead of silently restored wrong.
    """
    if v is None or isinstance(v, (bool, int, float, str, complex)):
        return v
    if isinstance(v, torch.Tensor):
        return _TensorRef(v, v._version)
    # a list, tuple, namedtuple or plain dict: the same container with the children's values
    if depth < 2 and (type(v) in (tuple, list, dict) or isinstance(v, tuple) and hasattr(v, "_fields")):
        items = [_value(x, depth + 1) for x in (v.values() if type(v) is dict else v)]
        if all(x is not _NOT_STATE for x in items):
            return tree_unflatten(items, tree_structure(v, is_leaf=lambda x: x is not v))
    return _NOT_STATE


@dataclass(slots=True)
class _TensorRef:
    tensor: torch.Tensor
    version: int


def _get(v: Any) -> Any:
    """The value :func:`_value` saved, in fresh containers (the step may have changed the old ones in place)."""
    return tree_map_only(_TensorRef, lambda r: r.tensor, v)


def module_tensor_attrs(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
    """Tensors (or tuples of them, or None) kept as plain attributes of modules: ``(module, attr, name)``."""
    out = []
    for qual, m in model.named_modules():
        for k, v in vars(m).items():
            if k in _MODULE_INTERNALS or k.startswith("__"):
                continue
            # None too: state a forward sets later (self.hidden = None until the first step)
            if v is None or isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and v
                                                            and all(isinstance(x, torch.Tensor) for x in v)):
                out.append((m, k, f"{qual}.{k}" if qual else k))
    return out


def _callable_holders(fn: Any) -> list[tuple[str, Any, str]]:
    """Where a step function keeps state between calls: ``(kind, holder, key)`` with kind "cell"
    (a closure variable) or "attr" (an attribute of the object a bound method or callable object is)."""
    out: list[tuple[str, Any, str]] = []
    seen: set[int] = set()

    def visit(f: Any, depth: int) -> None:
        if f is None or id(f) in seen or depth > 2:
            return
        seen.add(id(f))
        if isinstance(f, types.MethodType):
            visit(f.__func__, depth)
            owner = f.__self__
            # module attributes are covered by module_tensor_attrs
            if not isinstance(owner, torch.nn.Module) and hasattr(owner, "__dict__"):
                out.extend(("attr", owner, k) for k in vars(owner) if not k.startswith("__"))
            return
        if isinstance(f, types.FunctionType):
            names = f.__code__.co_freevars
            for name, cell in zip(names, f.__closure__ or ()):
                out.append(("cell", cell, name))
                try:
                    inner = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(inner, (types.FunctionType, types.MethodType)):
                    visit(inner, depth + 1)   # a helper closure the step calls
            return
        if callable(f) and hasattr(f, "__dict__") and not isinstance(f, (type, torch.nn.Module)):
            out.extend(("attr", f, k) for k in vars(f) if not k.startswith("__"))
            visit(getattr(type(f), "__call__", None), depth + 1)

    visit(fn, 0)
    return out


def _put(kind: str, holder: Any, key: str, value: Any) -> None:
    setattr(holder, "cell_contents" if kind == "cell" else key, value)


@dataclass(slots=True)
class _Held:
    kind: str
    holder: Any
    key: str
    value: Any      # _value(...) result


def capture_user_state(fns: Iterable[Any], owned: Iterable[torch.Tensor] = ()) -> list[_Held]:
    """The state the step functions keep between calls. ``owned``: tensors the snapshot already holds
    (the weights, their master copies): a closure variable holding only those is the same objects, not
    state of its own (a capsule must not replace the optimizer's master copies with copies of them)."""
    held: list[_Held] = []
    mine = {id(t) for t in owned}
    for fn in fns:
        for kind, holder, key in _callable_holders(fn):
            try:
                raw = getattr(holder, "cell_contents" if kind == "cell" else key)
            except (ValueError, AttributeError):
                continue
            many = raw if isinstance(raw, (list, tuple)) and raw else [raw]
            if mine and all(isinstance(t, torch.Tensor) and id(t) in mine for t in many):
                continue
            v = _value(raw)
            if v is not _NOT_STATE:
                held.append(_Held(kind, holder, key, v))
    return held


# -- the snapshot --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoragePolicy:
    """Where snapshots keep their tensors (``replay.snapshot_store`` etc. in the config)."""

    mode: str = "auto"             # auto | device | host | disk
    memory_mb: float = 32.0        # auto: states up to this size stay on the device
    directory: str | None = None   # disk: folder for the snapshot file (None: the system's temp folder)

    def new_store(self, device_type: str, nbytes: int) -> TensorStore:
        """An empty store for ``nbytes`` of tensors from ``device_type``, where this policy puts them (``auto``:
        on the device up to ``memory_mb``; above it, host memory for CUDA runs and a file for CPU runs)."""
        mode = self.mode
        if mode == "auto":
            mode = "device" if nbytes <= self.memory_mb * (1 << 20) else "host" if device_type == "cuda" else "disk"
        return TensorStore(mode, self.directory)


def _indexed_state(opt: torch.optim.Optimizer) -> dict[int, dict[Any, Any]]:
    """The optimizer's per-parameter state by the parameter's index in its param groups."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return {index[id(p)]: st for p, st in opt.state.items() if id(p) in index}


def _optimizer_layout(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's per-parameter state and groups, with every tensor left out (stored apart), and each
    group's parameter objects: a step may add a group (gradual unfreezing: optimizer.add_param_group)."""
    state = {i: {k: (None if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in st.items()}
             for i, st in _indexed_state(opt).items()}
    groups = [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
               for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"state": state, "groups": groups, "params": [list(g["params"]) for g in opt.param_groups]}


def _into(cur: Any, saved: Any) -> Any:
    """``saved`` written into the tensor ``cur`` where their layouts match (the object stays), else a copy."""
    if isinstance(saved, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == saved.shape \
            and cur.device == saved.device:
        with torch.no_grad():
            cur.copy_(saved)
        return cur
    return saved.clone() if isinstance(saved, torch.Tensor) else copy.deepcopy(saved)


def _want_dtype(p: torch.Tensor, key: Any, slot: Slot) -> torch.dtype:
    """torch's rule in Optimizer.load_state_dict: floating state follows the parameter's dtype,
    ``step`` keeps its own."""
    return p.dtype if key != "step" and slot.dtype.is_floating_point and p.is_floating_point() else slot.dtype


def _restore_optimizer(opt: torch.optim.Optimizer, layout: dict[str, Any],
                       slots: dict[tuple[int, Any], Slot], *, tensors: bool = True) -> None:
    """``tensors`` False: the state tensors still hold their saved values (no version counter moved since
    the last full restore), so they are not copied again; everything else is put back."""
    for i, p in enumerate([q for g in opt.param_groups for q in g["params"]]):
        want, have = layout["state"].get(i), opt.state.get(p)
        if want is None:
            if have:
                opt.state.pop(p, None)
            continue
        # the live state tensors are written in place where their layout still fits, else replaced
        fits = have is not None and have.keys() == want.keys() and all(
            isinstance(have[k], torch.Tensor) and have[k].shape == slot.shape and have[k].device == slot.device
            and have[k].dtype == _want_dtype(p, k, slot) for k in want if (slot := slots.get((i, k))) is not None)
        if not fits:
            have = opt.state[p] = {}
        for k, v in want.items():
            slot = slots.get((i, k))
            if slot is None:
                have[k] = copy.deepcopy(v)
            elif not fits:
                have[k] = slot.load().to(dtype=_want_dtype(p, k, slot))
            elif tensors:
                slot.copy_into(have[k])
    _restore_groups(opt, layout)


def _restore_group_structure(opt: torch.optim.Optimizer, layout: dict[str, Any]) -> None:
    """The param groups as they were (the same parameter objects in each): groups a step added since are
    dropped, groups it removed come back with their saved hyper-parameters."""
    have, groups = opt.param_groups, layout["params"]
    if [[id(p) for p in g["params"]] for g in have] == [[id(p) for p in ps] for ps in groups]:
        return
    rebuilt = []
    for i, ps in enumerate(groups):
        g = have[i] if i < len(have) else {k: copy.deepcopy(v) for k, v in layout["groups"][i].items()}
        g["params"] = list(ps)
        rebuilt.append(g)
    opt.param_groups[:] = rebuilt
    keep = {id(p) for ps in groups for p in ps}
    for p in [p for p in opt.state if id(p) not in keep]:
        del opt.state[p]


def _restore_groups(opt: torch.optim.Optimizer, layout: dict[str, Any], *, full: bool = True) -> None:
    """Put back each param group's hyper-parameters (a step may set the LR by hand); ``full`` False (a
    step stopped before its update): only the plain values, keys the step added stay."""
    for group, want in zip(opt.param_groups, layout["groups"]):
        for k, v in want.items():
            if full or not isinstance(v, torch.Tensor):
                group[k] = _into(group.get(k), v)
        for k in [k for k in group if full and k != "params" and k not in want]:
            del group[k]


def _versions(objects: Objects) -> list[tuple[torch.Tensor, int, int, torch.dtype]]:
    """Parameters and optimizer state tensors with their version counter, data pointer and dtype:
    equal lists mean nothing wrote to them (an in-place write bumps the version)."""
    tensors = [*objects.model.parameters(), *(m for _, m in objects.masters)]
    tensors += [v for _, opt in objects.optimizers for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]
    return [(t, t._version, t.data_ptr(), t.dtype) for t in tensors]


class SavedModel(Mapping):
    """A snapshot's parameters and buffers by qualified name; each is read from the store on access."""

    def __init__(self, entries: list[tuple[str, torch.Tensor, Slot]]):
        self._slots = {name: slot for name, _, slot in entries}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._slots[name].load()

    def __iter__(self):
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, name: str) -> Slot:
        return self._slots[name]


@dataclass(slots=True)
class Snapshot:
    """Everything a step reads besides its batch, at one moment; restorable exactly (see module doc)."""

    tensors: list[tuple[str, torch.Tensor, Slot]]   # (name, live parameter/buffer, its saved copy)
    optimizers: list[dict[str, Any]]                 # layouts (tensors in ``opt_slots``)
    opt_slots: list[dict[tuple[int, Any], Slot]]
    schedulers: list[dict[str, Any] | None]
    scalers: list[dict[str, Any]]
    rng: dict[str, Any]
    threads: int
    flags: list[tuple[torch.nn.Module, bool]]
    attrs: list[tuple[torch.nn.Module, str, Any, str]]   # (module, attribute, saved value, qualified name)
    user: list[_Held] = field(default_factory=list)
    store: TensorStore | None = None
    clean: list[tuple[torch.Tensor, int, int, torch.dtype]] | None = None   # after the last full restore
    trainable: list[tuple[torch.Tensor, bool]] = field(default_factory=list)   # a step may flip requires_grad

    @property
    def model(self) -> SavedModel:
        """The saved parameters and buffers by qualified name (read on access)."""
        return SavedModel(self.tensors)

    @property
    def storage(self) -> str:
        return self.store.mode if self.store is not None else "device"

    def changed_in_place(self) -> list[str]:
        """Names of carried tensors (closure variables, module attributes) the step changed in place."""
        held = [(h.key, h.value) for h in self.user] + [(qual, v) for _, _, v, qual in self.attrs]
        return [name for name, v in held
                if any(isinstance(r, _TensorRef) and r.tensor._version != r.version for r in tree_leaves(v))]

    def carried(self) -> dict[str, Any]:
        """The state the step keeps between calls, by name (for a capsule): module attributes by
        qualified name, closure variables by name, attributes of the step's owner object."""
        cells, owner = {}, {}
        for h in self.user:
            (cells if h.kind == "cell" else owner)[h.key] = _get(h.value)
        return {"attrs": {qual: _get(v) for _, _, v, qual in self.attrs}, "cells": cells, "owner": owner}

    def restore(self, objects: Objects, *, partial_ok: bool = False) -> None:
        """Write the saved state back into the user's objects (the same objects it was taken from).

        ``partial_ok``: when no parameter and no optimizer state tensor changed since the last full
        restore (their version counters, pointers and dtypes say so: a step stopped before its
        update), only the parts a forward and backward pass change are written back (buffers, RNG,
        flags, carried state, LR groups, schedulers, GradScalers) and gradients are dropped. A full
        restore in that case copies the parameters but not the optimizer state (only an update
        writes it; after reruns that stopped before theirs it is most of the state's bytes).
        """
        for (_, opt), layout in zip(objects.optimizers, self.optimizers):
            _restore_group_structure(opt, layout)
        for p, flag in self.trainable:
            if p.requires_grad != flag:
                p.requires_grad_(flag)
        untouched = self._untouched(objects)
        full = not (partial_ok and untouched)
        params = set() if full else {id(p) for p in objects.model.parameters()}
        with torch.no_grad():
            for _, live, slot in self.tensors:
                if id(live) in params:
                    continue
                if live.shape == slot.shape:
                    slot.copy_into(live)
                else:  # a parameter the step resized (rare): rebind its data
                    live.data = slot.load().to(live.dtype)
        if full:
            for (_, opt), layout, slots in zip(objects.optimizers, self.optimizers, self.opt_slots):
                _restore_optimizer(opt, layout, slots, tensors=not untouched)
        else:
            for (_, opt), layout in zip(objects.optimizers, self.optimizers):
                _restore_groups(opt, layout, full=False)
            for p in [*objects.model.parameters(), *(m for _, m in objects.masters)]:
                p.grad = None
        for (_, sched), saved in zip(objects.schedulers, self.schedulers):
            if saved is not None:
                sched.load_state_dict(copy.deepcopy(saved))
        for (_, scaler), saved in zip(objects.scalers(), self.scalers):
            _restore_scaler(scaler, saved)
        for m, flag in self.flags:
            m.training = flag
        for m, name, v, _ in self.attrs:
            setattr(m, name, _get(v))
        for h in self.user:
            _put(h.kind, h.holder, h.key, _get(h.value))
        torch.set_num_threads(self.threads)
        set_rng(self.rng)
        if full:
            self.clean = _versions(objects)

    def _untouched(self, objects: Objects) -> bool:
        if self.clean is None:
            return False
        now = _versions(objects)
        return len(now) == len(self.clean) and all(
            a[0] is b[0] and a[1:] == b[1:] for a, b in zip(now, self.clean))

    def release(self) -> None:
        """Free the stored tensors (the snapshot file too) now rather than at garbage collection."""
        if self.store is not None:
            self.store.close()


_SCALER_ATTRS = ("_init_scale", "_growth_factor", "_backoff_factor", "_growth_interval", "_init_growth_tracker",
                 "_scale", "_growth_tracker")


def _scaler_state(scaler: torch.amp.GradScaler) -> dict[str, Any] | None:
    """A GradScaler's state without a device sync (its scale stays a tensor). A disabled one (created
    with enabled=False, as nanoGPT does on fp32/bf16) has no state: None."""
    if not scaler.is_enabled():
        return None
    state = {a: getattr(scaler, a, None) for a in _SCALER_ATTRS}
    return {a: v.detach().clone() if isinstance(v, torch.Tensor) else v for a, v in state.items()}


def _restore_scaler(scaler: torch.amp.GradScaler, saved: dict[str, Any] | None) -> None:
    if saved is None:
        return
    scaler._enabled = True
    for a, value in saved.items():
        setattr(scaler, a, _into(getattr(scaler, a, None), value))
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


@dataclass(slots=True)
class Objects:
    """The user's training objects, as the snapshot sees them."""

    model: torch.nn.Module
    optimizers: list[tuple[str, torch.optim.Optimizer]]
    schedulers: list[tuple[str, Any]]
    user_scalers: list[tuple[str, torch.amp.GradScaler]]
    fns: tuple[Any, ...]                 # the step functions whose closure state is carried
    own_scalers: list[tuple[str, torch.amp.GradScaler]] = field(default_factory=list)
    attrs: list[tuple[torch.nn.Module, str, str]] | None = None   # module tensor attributes (found lazily)
    masters: list[tuple[str, torch.Tensor]] = field(default_factory=list)   # optimizer tensors outside the model
    storage: StoragePolicy = field(default_factory=StoragePolicy)

    def scalers(self) -> list[tuple[str, torch.amp.GradScaler]]:
        return self.own_scalers + self.user_scalers

    def take(self, rng: dict[str, Any] | None = None, reuse: Snapshot | None = None) -> Snapshot:
        """Copy the state now (``rng``: the RNG states to store instead of the current ones). ``reuse``: an
        earlier snapshot of these objects whose storage (buffers or file) is overwritten when the layout is
        unchanged, so a rolling snapshot allocates nothing new."""
        if self.attrs is None:
            self.attrs = module_tensor_attrs(self.model)
        # float32 master copies of the weights are saved and restored like them
        named = [*self.model.named_parameters(), *self.model.named_buffers(), *self.masters]
        opt_tensors = [[(i, k, v) for i, st in _indexed_state(o).items() for k, v in st.items()
                        if isinstance(v, torch.Tensor)] for _, o in self.optimizers]
        flat = [t for _, t in named] + [t for ts in opt_tensors for _, _, t in ts]
        device_type = device_of(self.model).type
        if reuse is not None and reuse.store is not None:
            store = reuse.store
            old = [s for _, _, s in reuse.tensors] + [s for slots in reuse.opt_slots for s in slots.values()]
        else:
            store = self.storage.new_store(device_type, sum(t.numel() * t.element_size() for t in flat))
            old = None
        slots = iter(store.put_all(flat, reuse=old))
        return Snapshot(
            tensors=[(name, live, next(slots)) for name, live in named],
            optimizers=[_optimizer_layout(o) for _, o in self.optimizers],
            opt_slots=[{(pi, k): next(slots) for pi, k, _ in ts} for ts in opt_tensors],
            schedulers=[copy.deepcopy(s.state_dict()) if callable(getattr(s, "state_dict", None)) else None
                        for _, s in self.schedulers],
            scalers=[_scaler_state(s) for _, s in self.scalers()],
            rng=rng if rng is not None else capture_rng(device_type),
            threads=torch.get_num_threads(),
            flags=[(m, m.training) for m in self.model.modules()],
            attrs=[(m, name, _value(getattr(m, name, None)), qual) for m, name, qual in self.attrs],
            user=capture_user_state(self.fns, [t for _, t in named]),
            store=store,
            trainable=[(p, p.requires_grad) for p in self.model.parameters()],
        )


def objects_of(target: Any, own_scalers: list[tuple[str, torch.amp.GradScaler]] | None = None) -> Objects:
    """The Objects view of a :class:`nanprobe.reach.target.Target`."""
    fns = tuple(f for f in (target.step_fn, target.loss_fn) if f is not None)
    return Objects(model=target.model, optimizers=target.optimizers, schedulers=target.schedulers,
                   user_scalers=target.user_scalers, fns=fns, own_scalers=list(own_scalers or []),
                   masters=target.masters)


def apply_carried(carried: dict[str, Any], objects: Objects, notes: list[str]) -> None:
    """Put state a capsule carried (see :meth:`Snapshot.carried`) into a fresh entrypoint's objects."""
    model = objects.model
    for qual, value in (carried.get("attrs") or {}).items():
        path, _, attr = str(qual).rpartition(".")
        try:
            module = model.get_submodule(path) if path else model
        except AttributeError:
            notes.append(f"the capsule carries {qual}, which this model has no module for")
            continue
        setattr(module, attr, value)
    holders = [h for fn in objects.fns for h in _callable_holders(fn)]
    for group, kind in (("cells", "cell"), ("owner", "attr")):
        for name, value in (carried.get(group) or {}).items():
            match = next((h for h in holders if h[0] == kind and h[2] == name), None)
            if match is None:
                notes.append(f"the capsule carries the step's {name!r}, which this entrypoint's step does not keep")
                continue
            _put(*match, value)


__all__ = ["Snapshot", "Objects", "objects_of", "RngTracker", "capture_rng", "set_rng", "module_tensor_attrs",
           "capture_user_state", "apply_carried", "borrowed_globals", "borrows_globals"]


# -- the caller's global state ------------------------------------------------------------------------

@contextlib.contextmanager
def borrowed_globals():
    """Run a library call inside the caller's process without leaving a trace in its global state.

    Saved on entry and put back on exit (errors and interrupts too): the RNG streams (torch, every
    CUDA device, Python ``random``, numpy), the thread count, the default dtype, grad mode, anomaly
    mode (and its check_nan), autocast (CPU and CUDA), deterministic-algorithm flags, TF32 and cuDNN
    flags, float32 matmul precision. Inside, grad mode is on and anomaly mode off (nanprobe turns
    anomaly mode on itself where it needs a node's forward stack): a caller debugging with
    ``detect_anomaly`` or under ``torch.no_grad()`` gets the same diagnosis as anyone else.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    mm, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    flags = mm.allow_tf32, cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic
    undo = [   # each setter with the arguments that put back the value it has now
        (set_rng, capture_rng("cuda" if cuda else "cpu", host=True)),
        (torch.set_num_threads, torch.get_num_threads()), (torch.set_default_dtype, torch.get_default_dtype()),
        (torch.set_grad_enabled, torch.is_grad_enabled()),
        (torch.set_anomaly_enabled, torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        *[(torch.set_autocast_enabled, d, torch.is_autocast_enabled(d)) for d in ("cpu", "cuda")],
        *[(torch.set_autocast_dtype, d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")],
        (lambda on, warn: torch.use_deterministic_algorithms(on, warn_only=warn),
         torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        (torch.set_float32_matmul_precision, torch.get_float32_matmul_precision())]
    try:
        torch.set_grad_enabled(True)
        torch.set_anomaly_enabled(False)
        for d in ("cpu", "cuda"):
            torch.set_autocast_enabled(d, False)
        yield
    finally:
        # the flags first: assigning mm.allow_tf32 overwrites the float32 matmul precision (a user's "medium"
        # would come back "high", and torch 2.9+ then refuses to read it back), so the precision goes back last
        mm.allow_tf32, cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic = flags
        for put, *args in undo:
            put(*args)


def borrows_globals(fn):
    """Decorator: the library call runs inside :func:`borrowed_globals` (entered afresh on each call)."""
    return borrowed_globals()(fn)
