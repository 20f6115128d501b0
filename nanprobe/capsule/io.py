"""Capsule files: build the dict, write it atomically under a unique name, read and check it.

Format 2 is what the package docstring lists; format 1 capsules (one batch, one optimizer) still load.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import random
import re
import shlex
import shutil
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..base.version import __version__
from ..base.errors import CapsuleError, short_path
from ..base.precision import Precision, device_of, parse_precision
from ..base.report import Status, StepRecord
from ..base.sharding import full_value
from . import sharded
from .codec import (SUFFIX, capsule_name, compiled_graphs, encode_batch, fingerprint, publish, rng_to_safe, safe_value,
                    unwrap)

FORMAT = 2
MAGIC = "nanprobe_capsule"
NAME = re.compile(r"^step(\d+)-rank(\d+)-.*" + re.escape(SUFFIX) + r"$")
_REQUIRED = ("step", "precision", "model", "fingerprint", "rng", "history")


def record_dict(r: StepRecord | dict) -> dict[str, Any]:
    return asdict(r) if isinstance(r, StepRecord) else dict(r)


def to_record(d: dict[str, Any]) -> StepRecord:
    def num(key, kind=float):   # a number of that kind (a float also from an int), else None
        v = d.get(key)
        return kind(v) if isinstance(v, (int, kind)) and not isinstance(v, bool) else None

    losses = d.get("losses") if isinstance(d.get("losses"), Mapping) else {}
    return StepRecord(step=int(d.get("step", -1)), loss=num("loss"), grad_norm=num("grad_norm"), lr=num("lr"),
                      update_ratio=num("update_ratio"), finite=bool(d.get("finite", True)),
                      skipped=bool(d.get("skipped", False)), scale=num("scale"), epoch=num("epoch", int),
                      index=num("index", int),
                      losses={str(k): float(v) for k, v in losses.items() if isinstance(v, (int, float))})


def build(*, model: torch.nn.Module, optimizers: list[Any], schedulers: list[Any],
          scalers: list[torch.amp.GradScaler], micro_batches: list[Any] | None, rng: dict[str, Any],
          micro_rng: list[dict[str, Any]] | None, step: int, precision: Precision | str, status: str,
          reason: str | None, record: dict[str, Any], history: list[dict[str, Any]], entry: str | None = None,
          rank: int = 0, world_size: int = 1, local: bool = True, max_grad_norm: float | None = None,
          threads: int | None = None, position: dict[str, Any] | None = None,
          carried: dict[str, Any] | None = None, grad_scaler: bool = False, form: str = "loss_fn") -> dict[str, Any]:
    """Everything to replay one step, as a dict that torch.load(weights_only=True) accepts."""
    dropped: list[str] = []
    module = unwrap(model)
    dcp = sharded.wanted(model, world_size, optimizers)   # FSDP/DDP: tensors go to DCP when written, not gathered
    device = device_of(module)
    own = {id(p) for p in module.parameters()}
    scheds = [safe_value(s.state_dict(), dropped, f"scheduler[{i}]") if callable(getattr(s, "state_dict", None))
              else None for i, s in enumerate(schedulers)]
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
        "form": form,
        "grad_scaler": bool(grad_scaler),
        "max_grad_norm": None if max_grad_norm is None else float(max_grad_norm),
        "fingerprint": fingerprint(module),
        "compiled": compiled_graphs() > 0,   # the run used torch.compile: its numerics are not eager's
        "model": {} if dcp else OrderedDict((k, full_value(v.detach())) for k, v in module.state_dict().items()),
        "optimizers": [] if dcp else [safe_value(o.state_dict(), dropped, f"optimizer[{i}]")
                                      for i, o in enumerate(optimizers)],
        # tensors the optimizers step outside the model: float32 master copies of fp16/bf16 weights
        "masters": [p.detach() for o in optimizers for g in o.param_groups for p in g["params"] if id(p) not in own],
        "schedulers": scheds,
        "scalers": [safe_value(s.state_dict(), dropped, f"scaler[{i}]") if s.is_enabled() else {}
                    for i, s in enumerate(scalers)],
        "micro_batches": [encode_batch(b) for b in micro_batches or ()],
        "batch_missing": micro_batches is None,
        "rng": rng_to_safe(rng),
        "micro_rng": [rng_to_safe(r) for r in (micro_rng or [])],
        "position": safe_value(position, dropped, "position"),
        "carried": safe_value(carried or {}, dropped, "carried"),
        "record": safe_value(record, dropped, "record"),
        "history": safe_value(list(history), dropped, "history"),
    }
    if dcp:
        data["sharded"] = {"kind": sharded.KIND}
    data["dropped"] = dropped
    return data


def write(data: dict[str, Any], folder: str | os.PathLike, *, model: torch.nn.Module | None = None,
          optimizers: list[Any] | None = None) -> Path:
    """Save a capsule under a new, unique name in ``folder``; never replaces an existing file.

    The file appears complete or not at all (written to a temporary name, then hard-linked). A capsule
    ``build`` made sharded (FSDP/DDP under torch.distributed) is a directory every rank writes into
    (``capsule.sharded``): it needs the live ``model`` and ``optimizers``, and every rank must call this.
    """
    if data.get("sharded"):
        if model is None:
            raise ValueError("a sharded capsule is written from the live model: pass model= and optimizers=")
        return sharded.write(data, folder, model, list(optimizers or []))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{os.getpid()}-{random.SystemRandom().getrandbits(48):012x}{SUFFIX}"
    with open(tmp, "xb") as fh:
        torch.save(data, fh)
    try:
        step, rank = int(data["step"]), int(data.get("rank", 0))
        return publish(tmp, lambda attempt: folder / capsule_name(step, rank, attempt), link=True)
    finally:
        if tmp.exists():
            tmp.unlink()


@dataclass(frozen=True, slots=True, kw_only=True)
class Capsule:
    """A capsule read back and checked; ``data`` is the raw dict (format 1 upgraded to format 2 keys)."""

    path: str
    step: int
    precision: Precision
    status: Status
    reason: str | None
    rank: int
    world_size: int
    local: bool
    device: str
    versions: dict[str, Any]
    data: dict[str, Any] = field(repr=False)


def _upgrade(data: dict[str, Any]) -> None:
    """Format 1 -> format 2 keys, in place."""
    for new, old in (("optimizers", "optimizer"), ("schedulers", "scheduler"), ("scalers", "scaler")):
        value = data.get(old)
        if new not in data:   # an empty scaler state ({}: GradScaler off) was no scaler
            data[new] = [] if value is None or (old == "scaler" and not value) else [value]
    if "micro_batches" not in data:
        data["micro_batches"] = [] if data.get("batch_missing") else [data.get("batch")]
    for key, default in (("micro_rng", []), ("carried", {}), ("position", None), ("form", "loss_fn")):
        data.setdefault(key, default)


_LOCAL, _END = b"PK\x03\x04", b"PK\x05\x06"


def _needed_bytes(fh) -> int | None:
    """The bytes of a torch.save pickle (read from ``fh``'s position) plus the tensor data it refers to
    (its persistent ids name each storage's dtype and element count). Nothing in it is called: every
    global resolves to an inert stand-in."""
    import pickle

    sizes: dict[str, int] = {}

    class Inert:   # stands in for every object the pickle builds: takes items, appends and state, does nothing
        def __init__(self, *args, **kwargs): pass
        def __setitem__(self, key, value): pass
        def __setstate__(self, state): pass
        def append(self, value): pass
        def extend(self, values): pass

    dtypes = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
              "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
              "Bool": torch.bool, "ComplexFloat": torch.complex64, "ComplexDouble": torch.complex128}

    class Reader(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "torch" and name.endswith("Storage"):
                return dtypes.get(name.removesuffix("Storage"), torch.uint8)
            return Inert

        def persistent_load(self, pid):
            if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
                dtype = pid[1] if isinstance(pid[1], torch.dtype) else torch.uint8
                sizes[str(pid[2])] = int(pid[4]) * dtype.itemsize
            return None

    start = fh.tell()
    try:
        Reader(fh).load()   # stops at the pickle's end: the file position says how long it is
    except Exception:  # noqa: BLE001 - a pickle cut short or of another layout: no estimate
        return None
    return fh.tell() - start + sum(sizes.values())


def truncation(path: str | os.PathLike) -> tuple[int, int | None] | None:
    """``(size, expected)`` when a torch.save (zip) file lacks its end record (it was cut off): the bytes
    found and, where its first record (data.pkl) is whole, at least how many it needs (the pickle and every
    tensor it lists), else None. None when the file is complete or not a torch.save file."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(30)
        if head[:4] != _LOCAL:
            return None
        fh.seek(max(0, size - 65557))   # the end record: 22 bytes and a comment of at most 65535
        tail = fh.read()
        i = tail.rfind(_END)
        if i >= 0 and len(tail) - i >= 22 + int.from_bytes(tail[i + 20:i + 22], "little"):   # bytes may follow
            return None
        needed = None
        if len(head) == 30:
            nlen, xlen = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
            fh.seek(30)
            if fh.read(nlen).endswith(b"data.pkl"):
                fh.seek(30 + nlen + xlen)
                needed = _needed_bytes(fh)
    return size, (needed if needed is not None and needed > size else None)


def read(path: str | os.PathLike) -> Capsule:
    """Load a capsule with torch.load(weights_only=True) and check its layout; CapsuleError otherwise."""
    p = Path(path)
    where = str(path)
    if not p.is_file():
        raise CapsuleError(f"capsule {where} not found", where, "Give the path the guard printed")
    try:
        # memory-mapped: the tensors are read from the file as they are copied into the model and the
        # optimizer, never held as a second full copy of the state (copy-on-write: the file never changes)
        data = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - every way a file can fail to load
        text = str(exc)
        short = truncation(p)
        if short is not None:
            found, needed = short
            what = (f"file is truncated: {found:,} bytes, while the tensors it lists alone need {needed:,}" if needed
                    else f"file is truncated: it ends after {found:,} bytes, inside its own records")
            raise CapsuleError(what, where, "It was cut off while being written or copied: copy it again from "
                               "where the guard wrote it (the guard only gives a capsule its name once it is "
                               "complete)") from None
        if "Weights only load failed" in text or "unsupported" in text.lower() and "global" in text.lower():
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
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT:
        raise CapsuleError(f"capsule format {version!r} is newer than this nanprobe understands ({FORMAT})", where,
                           "Upgrade nanprobe")
    missing = [k for k in _REQUIRED if k not in data]
    if version == 1 and "batch" not in data:
        missing.append("batch")
    if missing:
        raise CapsuleError(f"capsule lacks {', '.join(missing)}", where, "The capsule is damaged; use another one")
    _upgrade(data)
    try:
        precision = parse_precision(data["precision"])
        status = Status(data.get("status", "nonfinite"))
        step = int(data["step"])
        if not isinstance(data["model"], Mapping) or not isinstance(data["fingerprint"], list):
            raise TypeError("model state")
        for key in ("optimizers", "schedulers", "scalers", "micro_batches", "micro_rng", "history"):
            if not isinstance(data[key], list):
                raise TypeError(key)
    except (ValueError, TypeError) as exc:
        raise CapsuleError(f"capsule fields are damaged ({exc})", where, "Use another capsule") from None
    return Capsule(path=where, step=step, precision=precision, status=status, reason=data.get("reason"),
                   rank=int(data.get("rank", 0)), world_size=int(data.get("world_size", 1)),
                   local=bool(data.get("local", True)), device=str(data.get("device", "cpu")),
                   versions=dict(data.get("versions") or {}), data=data)


def list_capsules(folder: str | os.PathLike, step: int | None = None) -> list[Path]:
    """Capsule files in ``folder`` (for ``step`` if given), by name; nothing is opened."""
    folder = Path(folder)
    found = folder.iterdir() if folder.is_dir() else ()
    return sorted(p for p in found if (m := NAME.match(p.name)) and (step is None or int(m.group(1)) == step))


def no_room(capsules: list[Path], limit: int) -> bool:
    """No capsule is written at all (``limit`` 0), or only the first bad step's (``limit`` 1)."""
    return limit == 0 or (limit == 1 and bool(capsules))


def prune(capsules: list[Path], limit: int, may_delete: Callable[[Path], bool] = lambda path: True) -> None:
    """Cut a guard's list of written capsules (oldest first) to ``limit``: the first capsule (the first
    bad step) and the newest stay; the files of the others are deleted where ``may_delete`` allows."""
    while len(capsules) > limit:
        old = capsules.pop(1)
        if old.is_dir():   # a sharded capsule's directory (every rank may get here: missing files are fine)
            if sharded.DIR_NAME.match(old.name):
                shutil.rmtree(old, ignore_errors=True)
        elif may_delete(old):
            with contextlib.suppress(OSError):
                old.unlink()


def carried_attrs(carried: Mapping[str, Any]) -> dict[str, Any]:
    """The ``carried`` field of a guard's capsule: the module tensor attributes a capsule can hold."""
    return {"attrs": {q: v for q, v in carried.items()
                      if v is None or isinstance(v, (torch.Tensor, tuple, list))}} if carried else {}


def report_stem(capsule: Path, rank: int) -> str:
    """The name (no suffix) of a report written beside capsule ``capsule``: a capsule file's own stem
    (``stepNNNNNNN-rankR-<time>-<pid>``); a sharded capsule's directory (one for every rank,
    ``stepNNNNNNN-<time>-<pid>``) with the rank after the step, as a file's."""
    if capsule.name.endswith(SUFFIX):
        return capsule.name[:-len(SUFFIX)]
    step, _, rest = capsule.name.removesuffix(sharded.DIR_SUFFIX).partition("-")
    return f"{step}-rank{rank}-{rest}" if rest else f"{step}-rank{rank}"


def replay_command(entry: str | None, path: str | os.PathLike) -> str:
    """The command that replays capsule ``path`` (``ENTRY`` where the entrypoint is not known)."""
    return f"nanprobe run {shlex.quote(entry) if entry else 'ENTRY'} --capsule {shlex.quote(short_path(path))}"

