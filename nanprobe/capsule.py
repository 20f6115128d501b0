"""Capsules: one training step, saved so that `nanprobe run --capsule FILE` replays it exactly.

A capsule is a ``torch.save`` file holding only what ``torch.load(weights_only=True)`` accepts
(tensors, dicts, lists, tuples, Python numbers and strings), so a capsule from a colleague can
never run code. It holds the model, optimizer, scheduler and GradScaler state *before* the
step, the batch (nested containers encoded as tagged dicts and rebuilt on load), the RNG states
(torch, CUDA, Python ``random`` and numpy, as tensors and lists), the step number, precision,
the recent loss / grad-norm / LR history, versions, and a model fingerprint (parameter names
and shapes) that tells a capsule from another model apart.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import os
import platform
import random
import re
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .errors import CapsuleError
from .precision import Precision, device_of, parse_precision
from .report import Status, StepRecord

FORMAT = 1
MAGIC = "nanprobe_capsule"
SUFFIX = ".capsule.pt"
_NAME = re.compile(r"^step(\d+)-rank(\d+)-.*" + re.escape(SUFFIX) + r"$")
_TAG = "__nanprobe__"
_REQUIRED = ("step", "precision", "model", "fingerprint", "batch", "rng", "history")


# -- the model fingerprint ------------------------------------------------------------------------

def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel / DataParallel wrappers (their state has no prefix)."""
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
        return inner
    return model


def fingerprint(model: torch.nn.Module) -> list[list[Any]]:
    """Parameter names and shapes: what must match for a capsule to belong to a model."""
    return [[name, list(p.shape)] for name, p in unwrap(model).named_parameters()]


def _fingerprint_difference(saved: list, model: torch.nn.Module) -> str | None:
    mine = {name: shape for name, shape in fingerprint(model)}
    theirs = {str(item[0]): list(item[1]) for item in saved}
    missing = [n for n in theirs if n not in mine]
    extra = [n for n in mine if n not in theirs]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"capsule has {len(missing)} parameter(s) the model lacks, e.g. {missing[0]!r}")
        if extra:
            parts.append(f"model has {len(extra)} parameter(s) the capsule lacks, e.g. {extra[0]!r}")
        return "; ".join(parts)
    for name, shape in theirs.items():
        if mine[name] != shape:
            return f"parameter {name!r} is {tuple(mine[name])} in the model but {tuple(shape)} in the capsule"
    return None


# -- weights_only-safe values ------------------------------------------------------------------------

_PLAIN = (bool, int, float, str, bytes, type(None), complex)


def safe_value(obj: Any, dropped: list[str], path: str = "") -> Any:
    """``obj`` with only types torch.load(weights_only=True) accepts; what cannot be kept is listed."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, enum.Enum):
        return safe_value(obj.value, dropped, path)
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, (torch.Size, torch.dtype, torch.device)):
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
            if not isinstance(k, (str, int, float, bool, type(None))):
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
                "items": [[_key(k), encode_batch(v)] for k, v in batch.items()]}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return {_TAG: "namedtuple", "type": _type_name(type(batch)), "fields": list(batch._fields),
                "items": [encode_batch(v) for v in batch]}
    if isinstance(batch, (list, tuple)):
        return {_TAG: "list" if isinstance(batch, list) else "tuple", "items": [encode_batch(v) for v in batch]}
    return {_TAG: "opaque", "type": _type_name(type(batch)), "repr": repr(batch)[:200]}


def _key(k: Any) -> Any:
    return k if isinstance(k, (str, int, float, bool, type(None))) else repr(k)


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
        return enc
    kind = enc[_TAG]
    if kind == "tensor":
        return _to_device(enc["data"], str(enc.get("device", "cpu")), device, notes)
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
                try:
                    return t(items)
                except Exception:  # noqa: BLE001 - fall back to a plain dict
                    pass
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


def _to_device(t: torch.Tensor, saved: str, fallback: torch.device | None, notes: list[str]) -> torch.Tensor:
    if saved.startswith("cuda"):
        if torch.cuda.is_available():
            try:
                return t.to(saved)
            except (RuntimeError, AssertionError):
                return t.to("cuda")
        if "cuda batch" not in " ".join(notes):
            notes.append("the capsule's cuda batch is replayed on cpu")
        return t
    return t


# -- RNG states ------------------------------------------------------------------------------------

def capture_rng(device_type: str, *, host: bool = True) -> dict[str, Any]:
    """The RNG states at this moment, as the raw objects (cheap: no conversion here).

    ``host=False`` skips Python's ``random`` and numpy (they cost ~10-40 us; torch's ~1 us).
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_device"] = torch.cuda.current_device()
    if host:
        state["python"] = random.getstate()
        np = sys.modules.get("numpy")
        if np is not None:
            state["numpy"] = np.random.get_state()
    return state


def same_numpy_state(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and a[2:] == b[2:] and bool((a[1] == b[1]).all())


def rng_to_safe(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": state["torch"].clone()}
    version, internal, gauss = state["python"]
    out["python"] = [int(version), list(internal), gauss]
    if "cuda" in state:
        out["cuda"] = state["cuda"].clone()
        out["cuda_device"] = int(state.get("cuda_device", 0))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        out["numpy"] = [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return out


def rng_from_safe(safe: dict[str, Any], device_type: str) -> dict[str, Any]:
    """Capsule RNG -> the format of nanprobe.loop.Snapshot.rng."""
    state: dict[str, Any] = {"torch": safe["torch"].to(torch.uint8).cpu(), "python": (
        int(safe["python"][0]), tuple(int(v) for v in safe["python"][1]), safe["python"][2])}
    if device_type == "cuda" and "cuda" in safe and torch.cuda.is_available():
        states = torch.cuda.get_rng_state_all()
        index = int(safe.get("cuda_device", 0))
        states[index if index < len(states) else 0] = safe["cuda"].to(torch.uint8).cpu()
        state["cuda"] = states
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in safe:
        name, keys, pos, has_gauss, cached = safe["numpy"]
        state["numpy"] = (name, np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
    return state


# -- writing --------------------------------------------------------------------------------------------

def record_dict(r: StepRecord | dict) -> dict[str, Any]:
    if isinstance(r, StepRecord):
        return {"step": r.step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr,
                "update_ratio": r.update_ratio, "finite": r.finite, "skipped": r.skipped, "scale": r.scale}
    return dict(r)


def _record(d: dict[str, Any]) -> StepRecord:
    def num(key):
        v = d.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return StepRecord(step=int(d.get("step", -1)), loss=num("loss"), grad_norm=num("grad_norm"), lr=num("lr"),
                      update_ratio=num("update_ratio"), finite=bool(d.get("finite", True)),
                      skipped=bool(d.get("skipped", False)), scale=num("scale"))


def build(*, model: torch.nn.Module, optimizer, scheduler, scaler, batch: Any, rng: dict[str, Any],
          step: int, precision: Precision | str, status: str, reason: str | None, record: dict[str, Any],
          history: list[dict[str, Any]], entry: str | None = None, rank: int = 0, world_size: int = 1,
          local: bool = True, max_grad_norm: float | None = None, threads: int | None = None) -> dict[str, Any]:
    """Everything to replay one step, as a dict that torch.load(weights_only=True) accepts."""
    dropped: list[str] = []
    module = unwrap(model)
    device = device_of(module)
    sched_state = None
    if scheduler is not None and hasattr(scheduler, "state_dict"):
        sched_state = safe_value(scheduler.state_dict(), dropped, "scheduler")
    data = {
        MAGIC: FORMAT,
        "versions": {"nanprobe": str(__version__), "torch": str(torch.__version__),
                     "python": str(platform.python_version()),
                     "cuda": None if torch.version.cuda is None else str(torch.version.cuda)},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "entry": entry,
        "step": int(step),
        "precision": parse_precision(precision).value,
        "status": str(status),
        "reason": reason,
        "local": bool(local),
        "rank": int(rank),
        "world_size": int(world_size),
        "device": str(device),
        "threads": int(threads if threads is not None else torch.get_num_threads()),
        "grad_scaler": scaler is not None and scaler.is_enabled(),
        "max_grad_norm": None if max_grad_norm is None else float(max_grad_norm),
        "fingerprint": fingerprint(module),
        "model": OrderedDict((k, v.detach()) for k, v in module.state_dict().items()),
        "optimizer": safe_value(optimizer.state_dict(), dropped, "optimizer") if optimizer is not None else None,
        "scheduler": sched_state,
        "scaler": safe_value(scaler.state_dict(), dropped, "scaler") if scaler is not None else None,
        "batch": encode_batch(batch),
        "batch_missing": batch is None,
        "rng": rng_to_safe(rng),
        "record": safe_value(record, dropped, "record"),
        "history": safe_value(list(history), dropped, "history"),
    }
    data["dropped"] = dropped
    return data


def capsule_name(step: int, rank: int, attempt: int = 0) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    extra = f"-{attempt}" if attempt else ""
    return f"step{step:07d}-rank{rank}-{stamp}-{os.getpid()}{extra}{SUFFIX}"


def write(data: dict[str, Any], folder: str | os.PathLike) -> Path:
    """Save a capsule under a new, unique name in ``folder``; never replaces an existing file.

    The file appears complete or not at all (written to a temporary name, then hard-linked).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{os.getpid()}-{random.SystemRandom().getrandbits(48):012x}{SUFFIX}"
    with open(tmp, "xb") as fh:
        torch.save(data, fh)
    try:
        for attempt in range(1000):
            final = folder / capsule_name(int(data["step"]), int(data.get("rank", 0)), attempt)
            try:
                os.link(tmp, final)
                return final
            except FileExistsError:
                continue
            except OSError:  # no hard links here (some network/FUSE file systems)
                if final.exists():
                    continue
                os.rename(tmp, final)
                return final
        raise OSError(f"no free capsule name in {folder}")
    finally:
        if tmp.exists():
            tmp.unlink()


# -- reading ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Capsule:
    """A capsule read back and checked; ``data`` is the raw dict."""

    path: str
    step: int
    precision: Precision
    status: Status
    reason: str | None
    rank: int
    world_size: int
    local: bool
    entry: str | None
    device: str
    created: str | None
    versions: dict[str, Any]
    data: dict[str, Any] = field(repr=False)


def read(path: str | os.PathLike) -> Capsule:
    """Load a capsule with torch.load(weights_only=True) and check its layout; CapsuleError otherwise."""
    p = Path(path)
    where = str(path)
    if not p.is_file():
        raise CapsuleError(f"capsule {where} not found", where, "Give the path the guard printed")
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every way a file can fail to load
        text = str(exc)
        if "Weights only load failed" in text or "Unsupported global" in text or "unsupported" in text.lower() \
                and "global" in text.lower():
            m = re.search(r"GLOBAL ([\w.]+)", text)
            what = ("file holds Python objects or code that a capsule never contains; refused to load it"
                    + (f" (it names {m.group(1)})" if m else ""))
        elif "zip" in text.lower() or "central directory" in text or isinstance(exc, EOFError):
            what = "file is truncated or not a torch.save file"
        else:
            what = f"file is not a readable capsule ({type(exc).__name__}: {text.splitlines()[0][:120] if text else ''})"
        raise CapsuleError(what, where, "Use a capsule written by nanprobe.Guard (it may have been cut off "
                                        "while copying)") from None
    if not isinstance(data, dict) or MAGIC not in data:
        raise CapsuleError("file is a torch.save file but not a nanprobe capsule", where,
                           "Give a file written by nanprobe.Guard (e.g. nanprobe-capsules/step...capsule.pt)")
    version = data.get(MAGIC)
    if not isinstance(version, int) or version > FORMAT:
        raise CapsuleError(f"capsule format {version!r} is newer than this nanprobe understands ({FORMAT})", where,
                           "Upgrade nanprobe")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise CapsuleError(f"capsule lacks {', '.join(missing)}", where, "The capsule is damaged; use another one")
    try:
        precision = parse_precision(data["precision"])
        status = Status(data.get("status", "nonfinite"))
        step = int(data["step"])
        if not isinstance(data["model"], Mapping) or not isinstance(data["fingerprint"], list):
            raise TypeError("model state")
    except (ValueError, TypeError):
        raise CapsuleError("capsule fields are damaged", where, "Use another capsule") from None
    return Capsule(path=where, step=step, precision=precision, status=status, reason=data.get("reason"),
                   rank=int(data.get("rank", 0)), world_size=int(data.get("world_size", 1)),
                   local=bool(data.get("local", True)), entry=data.get("entry"), device=str(data.get("device", "cpu")),
                   created=data.get("created"), versions=dict(data.get("versions") or {}), data=data)


def check_model(capsule: Capsule, model: torch.nn.Module) -> None:
    diff = _fingerprint_difference(capsule.data["fingerprint"], model)
    if diff:
        raise CapsuleError(f"capsule is from another model: {diff}", capsule.path,
                           "Pass the ENTRY that builds the model the guarded run trained")


# -- restoring: capsule -> Reached --------------------------------------------------------------------------

def reach_from_capsule(path: str | os.PathLike | Capsule, loaded, cfg=None, *, precision: str | Precision | None = None,
                       found_for: int | None = None, policy: str | None = None):
    """Restore the capsule into the entrypoint's freshly built objects and return the state before its step.

    The result is a :class:`nanprobe.replay.Reached`, so ``diagnose_target(loaded, reached=...)``
    diagnoses exactly the captured step. The target's precision, GradScaler use and clipping
    are taken from the capsule (what the guarded run really did); differences become notes.
    """
    from .loop import Snapshot, make_scaler
    from .replay import Reached

    cap = path if isinstance(path, Capsule) else read(path)
    target = loaded.target
    model = target.model
    check_model(cap, model)
    data = cap.data
    notes: list[str] = []
    device = device_of(model)
    try:
        with torch.no_grad():
            model.load_state_dict(data["model"])
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CapsuleError(f"model state does not load: {str(exc).splitlines()[0][:160]}", cap.path,
                           "Pass the ENTRY that builds the model the guarded run trained") from None
    if data.get("optimizer") is not None:
        if target.optimizer is None:
            notes.append("the capsule holds optimizer state but the entrypoint returns no optimizer; "
                         "the update phase is not replayed")
        else:
            try:
                target.optimizer.load_state_dict(data["optimizer"])
            except (ValueError, KeyError, RuntimeError, TypeError) as exc:
                raise CapsuleError(f"optimizer state does not match the entrypoint's optimizer: "
                                   f"{str(exc).splitlines()[0][:160]}", cap.path,
                                   "Return the same optimizer type and parameter groups as the guarded run") from None
    elif target.optimizer is not None:
        notes.append("the guarded run had no optimizer; the entrypoint's fresh optimizer state is used")
    if data.get("scheduler") is not None and target.scheduler is not None:
        try:
            target.scheduler.load_state_dict(data["scheduler"])
        except Exception as exc:  # noqa: BLE001 - a scheduler of another kind
            notes.append(f"scheduler state not restored ({type(exc).__name__}); the LR comes from the optimizer state")
    prec = parse_precision(precision) if precision is not None else cap.precision
    if prec is not cap.precision:
        notes.append(f"the guarded run trained in {cap.precision.value}; replayed in {prec.value} as asked")
    want_scaler = bool(data.get("grad_scaler")) and prec is Precision.FP16 and target.optimizer is not None
    if want_scaler != target.grad_scaler:
        notes.append(f"GradScaler {'on' if want_scaler else 'off'} as in the guarded run "
                     f"(the entrypoint says grad_scaler={target.grad_scaler})")
        target.grad_scaler = want_scaler
    mgn = data.get("max_grad_norm")
    if mgn != target.max_grad_norm:
        notes.append(f"gradient clipping {mgn if mgn else 'off'} as in the guarded run "
                     f"(the entrypoint says max_grad_norm={target.max_grad_norm})")
        target.max_grad_norm = mgn
    target.precision = prec
    scaler = make_scaler(target, prec, device.type)
    if scaler is not None and data.get("scaler"):
        scaler.load_state_dict(data["scaler"])
    snapshot = Snapshot.take(target, scaler)
    snapshot.rng = rng_from_safe(data["rng"], device.type)
    saved_threads = data.get("threads")
    if isinstance(saved_threads, int) and device.type == "cpu" and cap.device.startswith("cpu") \
            and 0 < saved_threads <= (os.cpu_count() or 1):
        snapshot.threads = saved_threads
    if cap.device.split(":")[0] != device.type:
        notes.append(f"the capsule was written on {cap.device}; replayed on {device.type}")
    if policy in (None, "native") and cap.device.startswith("cuda") and device.type == "cpu" and prec.autocast:
        policy = "cuda"
        notes.append("CUDA's autocast policy is emulated on CPU, as in the run that wrote the capsule")
    if data.get("batch_missing"):
        from .replay import batch_source
        batch = batch_source(target)(cap.step)
        notes.append(f"the guard saw no batch (optimizer_step without guard.step(batch)); "
                     f"using the entrypoint's batch for step {cap.step}")
    else:
        batch = decode_batch(data["batch"], device, notes)
    if data.get("dropped"):
        notes.append(f"not stored in the capsule: {', '.join(map(str, data['dropped'][:3]))}")
    record = _record(dict(data.get("record") or {}, step=cap.step))
    history = [_record(h) for h in data["history"] if isinstance(h, Mapping)]
    how = f"capsule {cap.path}" + (f" (found for --at {found_for})" if found_for is not None else "")
    if cap.world_size > 1:
        how += f" (rank {cap.rank} of {cap.world_size})"
    status = cap.status if cap.status in (Status.NONFINITE, Status.SPIKE) else Status.NONFINITE
    return Reached(step=cap.step, batch=batch, snapshot=snapshot, precision=prec, scaler=scaler, status=status,
                   reason=cap.reason, record=record, history=history, update_ratios={}, reached_by=how, notes=notes,
                   policy=policy or "native")


# -- finding a capsule for a step ----------------------------------------------------------------------------

def list_capsules(folder: str | os.PathLike, step: int | None = None) -> list[Path]:
    """Capsule files in ``folder`` (for ``step`` if given), by name; nothing is opened."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m and (step is None or int(m.group(1)) == step):
            out.append(p)
    return sorted(out)


def reach_for_step(step: int, loaded, cfg, *, precision: str | Precision | None = None,
                   policy: str | None = None):
    """For ``--at N``: the Reached state of a usable capsule for step N in cfg.guard.capsule_dir, or None.

    Returns ``(reached_or_None, notes)``; capsules that cannot be used are skipped with a note.
    """
    notes: list[str] = []
    candidates = []
    for p in list_capsules(cfg.guard.capsule_dir, step):
        try:
            cap = read(p)
            check_model(cap, loaded.target.model)
        except CapsuleError as err:
            notes.append(f"capsule {p} for step {step} not used: {err.what}")
            continue
        candidates.append(cap)
    if not candidates:
        return None, notes
    # the rank that saw the problem first, then rank 0, then the newest
    candidates.sort(key=lambda c: (not c.local, c.rank, -(Path(c.path).stat().st_mtime)))
    reached = reach_from_capsule(candidates[0], loaded, cfg, precision=precision, found_for=step, policy=policy)
    reached.notes[:0] = notes
    return reached, []


__all__ = ["Capsule", "build", "write", "read", "check_model", "reach_from_capsule", "reach_for_step", "capsule_reach",
           "list_capsules", "fingerprint", "encode_batch", "decode_batch", "capture_rng"]


def capsule_reach(loaded, cfg, *, capsule: str | os.PathLike | None, at: int | None,
                  precision: str | Precision | None = None, policy: str | None = None):
    """`nanprobe run`'s first stop: ``--capsule FILE``, or a capsule for ``--at N`` in guard.capsule_dir.

    Returns ``(reached_or_None, notes)``: None means "replay as usual" (notes say why a capsule
    found for the step was not used).
    """
    if capsule is not None:
        reached = reach_from_capsule(capsule, loaded, cfg, precision=precision, policy=policy)
        if at is not None and at != reached.step:
            from .errors import UsageError
            raise UsageError(f"the capsule holds step {reached.step}, not --at {at}", str(capsule),
                             "Drop --at (the capsule fixes the step) or give the capsule of that step")
        return reached, []
    if at is not None:
        return reach_for_step(at, loaded, cfg, precision=precision, policy=policy)
    return None, []
