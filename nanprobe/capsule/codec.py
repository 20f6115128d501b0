"""The weights_only-safe encoding of what a capsule holds: model fingerprint, plain values,
nested batches and RNG states.

``torch.load(weights_only=True)`` accepts tensors, dicts, lists, tuples, Python numbers and
strings only: no numpy objects, no ``torch.Generator``, no namedtuples or dataclasses. Batches
are encoded as tagged dicts and rebuilt on load (their classes are looked up among modules
already imported, never imported); RNG states become tensors and lists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import enum
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CapsuleError
from ..base.sharding import full_value

SUFFIX = ".capsule.pt"


def capsule_name(step: int, rank: int, attempt: int = 0) -> str:
    """A capsule file's name: its step, rank, time and process, unique within a folder."""
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    return f"step{step:07d}-rank{rank}-{stamp}-{os.getpid()}{f'-{attempt}' if attempt else ''}{SUFFIX}"

def publish(tmp: Path, names: Callable[[int], Path], *, link: bool) -> Path:
    """Give the complete ``tmp`` the first free name of ``names(0)``, ``names(1)``, ...; never replaces
    anything: a file is hard-linked (which fails where the name is taken), a directory renamed."""
    for attempt in range(1000):
        final = names(attempt)
        if final.exists():
            continue
        try:
            (os.link if link else os.rename)(tmp, final)
            return final
        except OSError:
            if final.exists():   # taken meanwhile
                continue
            if not link:
                raise
            os.rename(tmp, final)   # no hard links here (some network/FUSE file systems)
            return final
    raise OSError(f"no free capsule name in {final.parent}")


_TAG = "__nanprobe__"


# -- the model fingerprint ------------------------------------------------------------------------

def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel / DataParallel and ``torch.compile`` wrappers (their
    state has no ``module.`` or ``_orig_mod.`` prefix), in any nesting."""
    while True:
        kind = type(model).__name__
        inner = getattr(model, "_orig_mod" if kind == "OptimizedModule" else "module", None)
        if not isinstance(inner, torch.nn.Module) or kind not in ("DistributedDataParallel", "DataParallel",
                                                                  "OptimizedModule"):
            return model
        model = inner


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled in this process (0 where it was never used: no import)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


def fingerprint(model: torch.nn.Module) -> list[list[Any]]:
    """Parameter names and shapes: what must match for a capsule to belong to a model."""
    return [[name, list(p.shape)] for name, p in unwrap(model).named_parameters()]


# -- weights_only-safe values ------------------------------------------------------------------------

_PLAIN = (bool, int, float, str, bytes, type(None), complex)
_KEYS = (str, int, float, bool, type(None))   # the dict keys a capsule keeps as they are


def safe_value(obj: Any, dropped: list[str], path: str = "") -> Any:
    """``obj`` with only types torch.load(weights_only=True) accepts; what cannot be kept is listed."""
    if isinstance(obj, torch.Tensor):
        return full_value(obj.detach())   # a DTensor shard: the full tensor (every rank gathers it)
    if isinstance(obj, enum.Enum):
        return safe_value(obj.value, dropped, path)
    if isinstance(obj, (*_PLAIN, torch.Size, torch.dtype, torch.device)):
        return obj
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return torch.from_numpy(obj.copy()) if obj.dtype != object else obj.tolist()
    if isinstance(obj, Mapping):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            if not isinstance(k, _KEYS):
                dropped.append(f"{path}[{k!r}]")
                continue
            out[k] = safe_value(v, dropped, f"{path}[{k!r}]")
        return out
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(safe_value(v, dropped, f"{path}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [safe_value(v, dropped, f"{path}[{i}]") for i, v in enumerate(obj)]
    dropped.append(f"{path} ({type(obj).__name__})")
    return None


# -- batches: nested containers -> tagged dicts, and back ----------------------------------------------

def encode_batch(batch: Any) -> Any:
    """A weights_only-safe form of a batch: every container becomes a tagged dict."""
    if isinstance(batch, torch.Tensor):
        return {_TAG: "tensor", "data": batch.detach(), "device": str(batch.device)}
    if isinstance(batch, _PLAIN):
        return batch
    np = sys.modules.get("numpy")
    if np is not None and isinstance(batch, np.generic):
        return batch.item()
    if np is not None and isinstance(batch, np.ndarray) and batch.dtype != object:
        return {_TAG: "ndarray", "data": torch.from_numpy(batch.copy())}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {_TAG: "dataclass", "type": _type_name(type(batch)),
                "fields": {f.name: encode_batch(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                           if f.init}}
    if isinstance(batch, Mapping):
        return {_TAG: "dict" if type(batch) is dict else "mapping", "type": _type_name(type(batch)),
                "items": [[k if isinstance(k, _KEYS) else repr(k), encode_batch(v)] for k, v in batch.items()]}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return {_TAG: "namedtuple", "type": _type_name(type(batch)), "fields": list(batch._fields),
                "items": [encode_batch(v) for v in batch]}
    if isinstance(batch, (list, tuple)):
        return {_TAG: "list" if isinstance(batch, list) else "tuple", "items": [encode_batch(v) for v in batch]}
    return {_TAG: "opaque", "type": _type_name(type(batch)), "repr": repr(batch)[:200]}


def _type_name(t: type) -> str:
    return f"{t.__module__}:{t.__qualname__}"


def _find_type(name: str, check) -> type | None:
    """A class named in a capsule, looked up among modules already imported (never imports anything).

    The run that wrote the capsule may have defined it in ``__main__`` while the entrypoint is
    imported under another name, so loaded entrypoint modules are searched by qualname too.
    """
    module_name, _, qualname = name.partition(":")
    candidates = [sys.modules.get(module_name)]
    candidates += [m for n, m in list(sys.modules.items())
                   if n.startswith("nanprobe_entry_") or n == "__main__"]
    for module in candidates:
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part, None) if obj is not None else None
        if isinstance(obj, type) and check(obj):
            return obj
    return None


def decode_batch(enc: Any, device: torch.device | None, notes: list[str]) -> Any:
    """Rebuild a batch from :func:`encode_batch`; tensors go back to their device where it exists."""
    if not isinstance(enc, dict) or _TAG not in enc:
        if isinstance(enc, (dict, list, tuple)):   # encode_batch tags every container it writes
            raise CapsuleError(f"a batch element is an untagged {type(enc).__name__}, which nanprobe never writes",
                               None, "The capsule is damaged; use another one")
        return enc
    kind = enc[_TAG]
    if kind in ("tensor", "ndarray") and not isinstance(enc.get("data"), torch.Tensor):
        raise CapsuleError(f"a batch {kind} holds a {type(enc.get('data')).__name__}, not a tensor", None,
                           "The capsule is damaged; use another one")
    if kind == "tensor":   # back on the device it was saved from, where this machine has it
        t, saved = enc["data"], str(enc.get("device", "cpu"))
        if saved.startswith("cuda") and torch.cuda.is_available():
            try:
                return t.to(saved)
            except (RuntimeError, AssertionError):
                return t.to("cuda")
        if saved.startswith("cuda") and "cuda batch" not in " ".join(notes):
            notes.append("the capsule's cuda batch is replayed on cpu")
        return t
    if kind == "ndarray":
        return enc["data"].numpy()
    if kind in ("list", "tuple"):
        items = [decode_batch(v, device, notes) for v in enc["items"]]
        return items if kind == "list" else tuple(items)
    if kind in ("dict", "mapping"):
        items = [(k, decode_batch(v, device, notes)) for k, v in enc["items"]]
        if kind == "mapping":
            t = _find_type(enc.get("type", ""), lambda c: issubclass(c, Mapping))
            if t is not None:
                with contextlib.suppress(Exception):   # else a plain dict
                    return t(items)
            notes.append(f"batch mapping type {enc.get('type')} rebuilt as a dict")
        return dict(items)
    if kind == "namedtuple":
        items = [decode_batch(v, device, notes) for v in enc["items"]]
        t = _find_type(enc.get("type", ""), lambda c: issubclass(c, tuple) and hasattr(c, "_fields")
                       and list(c._fields) == list(enc["fields"]))
        if t is not None:
            return t(*items)
        notes.append(f"batch namedtuple {enc.get('type')} is not importable here; rebuilt as a tuple")
        return tuple(items)
    if kind == "dataclass":
        values = {k: decode_batch(v, device, notes) for k, v in enc["fields"].items()}
        t = _find_type(enc.get("type", ""), lambda c: dataclasses.is_dataclass(c)
                       and {f.name for f in dataclasses.fields(c) if f.init} == set(values))
        if t is not None:
            return t(**values)
        notes.append(f"batch dataclass {enc.get('type')} is not importable here; rebuilt as a dict")
        return values
    if kind == "opaque":
        notes.append(f"batch held a {enc.get('type')} that a capsule cannot store; it is None in the replay")
        return None
    raise CapsuleError(f"unknown batch element {kind!r}", None, "The capsule is damaged or from a newer nanprobe")


# -- RNG states ------------------------------------------------------------------------------------

def rng_to_safe(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`nanprobe.reach.state.capture_rng` -> lists and tensors (streams not captured stay absent)."""
    out: dict[str, Any] = {"torch": state["torch"].clone()}
    if "python" in state:
        version, internal, gauss = state["python"]
        out["python"] = [int(version), list(internal), gauss]
    if "cuda" in state:
        cuda = state["cuda"]
        out["cuda"] = [t.clone() for t in cuda] if isinstance(cuda, (list, tuple)) else [cuda.clone()]
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        out["numpy"] = [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return out


def _rng_damage(safe: Any) -> str | None:
    """What is wrong with a capsule's RNG states (sizes and types against this torch and Python), or None.

    A state of the wrong size or type loads fine and fails only when it is set, deep in a replay."""
    if not isinstance(safe, Mapping):
        return f"it is a {type(safe).__name__}, not a dict of RNG states"
    t = safe.get("torch")
    want = torch.get_rng_state()
    if not isinstance(t, torch.Tensor):
        return f"'torch' is a {type(t).__name__}, not a tensor"
    if t.dtype is not torch.uint8 or t.numel() != want.numel():
        return (f"'torch' holds {t.numel()} {str(t.dtype).removeprefix('torch.')} values; this torch's CPU "
                f"generator state is {want.numel()} uint8")
    if "python" in safe:
        p = safe["python"]
        if not isinstance(p, (list, tuple)) or len(p) != 3 or not isinstance(p[1], (list, tuple)):
            return "'python' is not a Python random state (version, 625 integers, gauss)"
        if len(p[1]) != 625 or not all(isinstance(v, int) and not isinstance(v, bool) for v in p[1]):
            return f"'python' holds {len(p[1])} values, not 625 integers"
        if not all(0 <= v < 2 ** 32 for v in p[1][:624]) or not 0 <= p[1][624] <= 624:
            return "'python' holds values outside a Mersenne Twister state (32-bit words, position <= 624)"
        if not (p[2] is None or isinstance(p[2], float)):
            return "'python' has a gauss value that is neither None nor a float"
    if "numpy" in safe:
        n = safe["numpy"]
        if not isinstance(n, (list, tuple)) or len(n) != 5 or not isinstance(n[1], (list, tuple)) \
                or len(n[1]) != 624:
            return "'numpy' is not a numpy MT19937 state (name, 624 keys, pos, has_gauss, cached)"
    if "cuda" in safe:
        c = safe["cuda"]
        states = list(c) if isinstance(c, (list, tuple)) else [c]
        if not all(isinstance(x, torch.Tensor) and x.dtype is torch.uint8 and x.dim() == 1 for x in states):
            return "'cuda' is not a list of uint8 generator states"
        if torch.cuda.is_available():
            size = torch.cuda.get_rng_state().numel()
            bad = next((x.numel() for x in states if x.numel() != size), None)
            if bad is not None:
                return f"'cuda' holds a state of {bad} values; this CUDA generator's state is {size}"
    return None


def rng_from_safe(safe: Any, device_type: str, field: str = "rng") -> dict[str, Any]:
    """Capsule RNG -> the format of :func:`nanprobe.reach.state.capture_rng`; CapsuleError naming ``field`` when
    damaged."""
    damage = _rng_damage(safe)
    if damage:
        raise CapsuleError(f"capsule field {field!r} is damaged: {damage}", None, "Use another capsule")
    try:
        state: dict[str, Any] = {"torch": safe["torch"].to(torch.uint8).cpu()}
        if "python" in safe:
            p = safe["python"]
            state["python"] = (int(p[0]), tuple(int(v) for v in p[1]), p[2])
        if device_type == "cuda" and "cuda" in safe and torch.cuda.is_available():
            saved = safe["cuda"] if isinstance(safe["cuda"], (list, tuple)) else [safe["cuda"]]
            states = torch.cuda.get_rng_state_all()
            states[:len(saved)] = [t.to(torch.uint8).cpu() for t in saved[:len(states)]]
            state["cuda"] = states
        np = sys.modules.get("numpy")
        if np is not None and "numpy" in safe:
            name, keys, pos, has_gauss, cached = safe["numpy"]
            state["numpy"] = (str(name), np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError):
        raise CapsuleError(f"capsule field {field!r} is damaged", None, "Use another capsule") from None
    return state

