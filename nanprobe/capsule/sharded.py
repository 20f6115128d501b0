"""Sharded capsules: under FSDP2 (``fully_shard``), FSDP1 or DDP a bad step's capsule is a DIRECTORY.

Every rank of the run writes into the same directory, ``stepNNNNNNN-<time>-<pid>.capsule/``:

* the model and optimizer tensors through ``torch.distributed.checkpoint`` (DCP: ``.metadata`` and
  one ``__R_0.distcp`` file per rank). Each rank writes its own shards only: no rank gathers the full
  model (FSDP); a tensor every rank holds the same copy of (DDP's weights and optimizer state) is
  written once (DCP's de-duplication spreads those tensors over the ranks);
* ``rankR.pt``: that rank's small capsule file (batches, RNG states, record, history, settings, the
  optimizers' hyper-parameters), the same codec as a single-file capsule, loaded with
  ``torch.load(weights_only=True)``.

Nothing in a capsule directory can run code: the DCP metadata is read by an unpickler that builds only
DCP's own metadata classes, torch sizes and dtypes; tensor data is read with ``weights_only=True``.

``nanprobe run ENTRY --capsule DIR`` reads it on ONE process without a process group: the full
(resharded) weights and optimizer state go into the entrypoint's unsharded model, and each rank's
batch is replayed in turn to find the rank whose batch gives the first non-finite value.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CapsuleError, short_path
from ..base.sharding import collective_device, fsdp1_root, sharded
from .codec import SUFFIX, capsule_name, publish, safe_value, unwrap

DIR_SUFFIX = ".capsule"
DIR_NAME = re.compile(r"^step(\d+)-.*" + re.escape(DIR_SUFFIX) + r"$")
RANK_FILE = re.compile(r"^rank(\d+)\.pt$")
KIND = "dcp"


def wanted(model: torch.nn.Module, world_size: int, optimizers: list[Any] = ()) -> bool:
    """A capsule of this model is a DCP directory: a multi-rank run of FSDP2, FSDP1 or DDP (a model the
    ranks shard, or replicate), or a model every rank holds bitwise the same copy of with the same
    optimizer state (the module inside DDP, as ``watch`` and the callbacks see it: :func:`replicated`,
    two all-reduces). Any other model (each rank its own weights) keeps one file per rank. Every rank
    must call this (it may communicate)."""
    dist = torch.distributed
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return False
    return type(model).__name__ == "DistributedDataParallel" or sharded(unwrap(model)) \
        or fsdp1_root(model) is not None or replicated(unwrap(model), optimizers)


def replicated(module: torch.nn.Module, optimizers: list[Any] = ()) -> bool:
    """Every rank holds the same weights, buffers and optimizer state (DDP's replicas): each rank's
    checksums, all-reduced as max and -min, agree (a NaN never does). Every rank must call this."""
    dist = torch.distributed
    tensors = [v for v in module.state_dict().values() if isinstance(v, torch.Tensor)]
    for opt in optimizers:
        for p in (q for g in opt.param_groups for q in g["params"]):
            tensors += [v for _, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    device = collective_device()
    count = torch.tensor([len(tensors), -len(tensors)], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count[0].item() != -count[1].item():
        return False
    out = []   # two float64 sums per tensor (plain and position-weighted): bitwise copies give the same values
    for t in tensors:
        v = t.detach().reshape(-1).to(torch.float64)
        w = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device) / max(v.numel(), 1)
        out.append(torch.stack([v.sum(), (v * w).sum()]))
    sums = torch.cat(out).to(device) if out else torch.zeros(0, dtype=torch.float64, device=device)
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    n = sums.numel()
    return bool(torch.equal(both[:n], -both[n:])) if n else True


# -- writing --------------------------------------------------------------------------------------------


def _split(state: Mapping[str, Mapping[str, Any]], groups: list, dropped: list[str],
           i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Optimizer state keyed by parameter name: (tensors for DCP, the rest for the rank file)."""
    tensors: dict[str, dict[str, Any]] = {}
    rest: dict[str, dict[str, Any]] = {}
    for name, entry in state.items():
        for key, value in entry.items():
            (tensors if isinstance(value, torch.Tensor) else rest).setdefault(name, {})[key] = value
    return tensors, safe_value({"param_groups": groups, "state": rest}, dropped, f"optimizer[{i}]")


def _split_optimizer(opt: torch.optim.Optimizer, names: dict[int, str], dropped: list[str],
                     i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`_split` of a live optimizer, its parameters named by ``names`` (id -> name)."""
    state, groups = {}, []
    for g in opt.param_groups:
        params = []
        for p in g["params"]:
            name = names.get(id(p))
            if name is None:
                raise CapsuleError(f"optimizer[{i}] steps a tensor outside the model", None,
                                   "A sharded capsule names optimizer state by parameter name")
            params.append(name)
            state[name] = opt.state.get(p, {})
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    return _split(state, groups, dropped, i)


def _state(model: torch.nn.Module, optimizers: list[Any], dropped: list[str]) -> tuple[dict[str, Any], list]:
    """(what DCP saves: {"model": ..., "optimizers": {"0": ...}}, each optimizer's non-tensor part)."""
    if fsdp1_root(model) is not None:   # flat parameters: FSDP1's own sharded state dicts, keyed by the original names
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # FSDP1's ShardedTensor and process-group deprecations
            model_sd = get_model_state_dict(model)
            osds = [get_optimizer_state_dict(model, opt) for opt in optimizers]
        parts = [_split(osd["state"], osd["param_groups"], dropped, i) for i, osd in enumerate(osds)]
    else:
        module = unwrap(model)
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        model_sd = {k: v.detach() for k, v in module.state_dict().items()}   # DTensors stay sharded
        parts = [_split_optimizer(opt, names, dropped, i) for i, opt in enumerate(optimizers)]
    return {"model": model_sd, "optimizers": {str(i): t for i, (t, _) in enumerate(parts)}}, [m for _, m in parts]


def _intact(t: torch.Tensor) -> bool:
    """The tensor's storage holds every element it views (FSDP frees the unsharded parameters' storage)."""
    if t.numel() == 0:
        return True
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= (t.storage_offset() + span) * t.element_size()


def _on_rank0(fn: Any) -> Path:
    """``fn()`` (a path) run on rank 0, on every rank (one broadcast); its OSError raises on every rank."""
    dist = torch.distributed
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [str(fn())]
        except OSError as exc:
            box = [f"error: {exc.strerror or exc}"]
    dist.broadcast_object_list(box, src=0)
    text = str(box[0])
    if text.startswith("error: "):
        raise OSError(text[len("error: "):])
    return Path(text)


def write(data: dict[str, Any], folder: str | os.PathLike, model: torch.nn.Module,
          optimizers: list[Any]) -> Path:
    """Write the capsule directory of ``data`` (every rank calls this, with its own ``data``); returns it.

    The directory appears under its final name only once every rank's files are complete (written in a
    temporary directory, renamed by rank 0 after a barrier)."""
    import torch.distributed.checkpoint as dcp

    dist = torch.distributed
    rank = dist.get_rank()
    folder = Path(folder)
    step = int(data["step"])

    def new_tmp() -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tmp-step{step:07d}-{os.getpid()}-{random.SystemRandom().getrandbits(48):012x}"
        tmp.mkdir()
        return tmp

    tmp = _on_rank0(new_tmp)
    dropped = list(data.get("dropped") or [])
    try:
        state, metas = _state(model, optimizers, dropped)
        # collective: a rank's failure is raised on every rank (DCP gathers them)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True))
    except Exception as exc:  # noqa: BLE001 - every rank gets here together: no capsule, training goes on
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"torch.distributed.checkpoint failed: {type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else ''}") from None
    own = dict(data, model={}, optimizers=metas, sharded={"kind": KIND}, dropped=dropped)
    attrs = (own.get("carried") or {}).get("attrs")
    if isinstance(attrs, Mapping):   # FSDP1 keeps the original parameters as attributes: views of a freed buffer
        kept = {q: v for q, v in attrs.items() if not isinstance(v, torch.Tensor) or _intact(v)}
        dropped += [f"carried {q} (a view of freed memory)" for q in attrs if q not in kept]
        own["carried"] = dict(own["carried"], attrs=kept)
    if fsdp1_root(model) is not None:   # flat shards: the original names and full shapes, as the state holds them
        buffers = {re.sub(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.", "", n)
                   for n, _ in model.named_buffers()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)   # ShardedTensor's deprecation: FSDP1 state dicts use it
            own["fingerprint"] = [[k, list(v.size())] for k, v in state["model"].items() if k not in buffers]
    part = tmp / f".rank{rank}.part"
    failed = torch.zeros(1)
    try:
        with open(part, "xb") as fh:
            torch.save(own, fh)
        os.replace(part, tmp / f"rank{rank}.pt")
    except OSError:
        failed += 1
    # every rank's file is complete (and the barrier): one all-reduce, so a rank that failed stops none
    flag = failed.to(collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError("a rank could not write its file of the capsule")
    return _on_rank0(lambda: publish(tmp, lambda attempt: folder / (
        capsule_name(step, 0, attempt).replace("-rank0-", "-").removesuffix(SUFFIX) + DIR_SUFFIX), link=False))


def list_dirs(folder: str | os.PathLike, step: int) -> list[Path]:
    """The capsule directories of step ``step`` in ``folder``, newest first; nothing is opened."""
    folder = Path(folder)
    found = [p for p in (folder.iterdir() if folder.is_dir() else ())
             if (m := DIR_NAME.match(p.name)) and int(m.group(1)) == step and p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def is_capsule_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and any(RANK_FILE.match(q.name) for q in p.iterdir())


# -- reading --------------------------------------------------------------------------------------------

_META_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
     ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
     ("torch.serialization", "_get_layout"), ("torch", "Size"), ("collections", "OrderedDict")}


def _path_text(*parts: Any) -> str:
    return os.path.join(*(str(p) for p in parts)) if parts else ""


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle, with nothing but its own classes: no global can run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _META_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        if module in ("pathlib", "posixpath", "ntpath") and name in ("PosixPath", "WindowsPath", "PurePosixPath",
                                                                    "PureWindowsPath", "Path"):
            return _path_text   # the checkpoint's own path, informational: kept as text
        raise pickle.UnpicklingError(f"the DCP metadata names {module}.{name}, which a capsule never holds")


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            with open(Path(self.path) / ".metadata", "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _planner():
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class SafePlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:   # never: a capsule saves tensors only
            raise CapsuleError("the DCP files hold a pickled object, which a capsule never does", None,
                               "Use a capsule directory written by nanprobe")

    return SafePlanner()


def _metadata(p: Path):
    """The DCP metadata of capsule directory ``p``, read safely; CapsuleError when it is missing or names
    anything but DCP's own metadata classes."""
    if not (p / ".metadata").is_file():
        raise CapsuleError(f"capsule directory {short_path(p)} has no DCP .metadata", str(p),
                           "Copy the whole directory every rank wrote (it is incomplete)")
    try:
        return _reader(p).read_metadata()
    except pickle.UnpicklingError as exc:
        raise CapsuleError(f"{short_path(p / '.metadata')}: {exc}; refused to load it", str(p),
                           "Use a capsule directory written by nanprobe") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
        raise CapsuleError(f"{short_path(p / '.metadata')} is not DCP metadata ({type(exc).__name__})", str(p),
                           "Copy the whole directory every rank wrote (it is damaged)") from None


def state_bytes(path: str | os.PathLike) -> int:
    """The bytes of the full (unsharded) state a capsule directory holds, from its DCP metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return sum(math.prod(item.size) * item.properties.dtype.itemsize
               for item in _metadata(Path(path)).state_dict_metadata.values()
               if isinstance(item, TensorStorageMetadata))


def available_bytes() -> int | None:
    """Host memory available now (Linux /proc/meminfo MemAvailable), else None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """The full state of a capsule directory on this process, without a process group:
    ``{"model": {name: tensor}, "optimizers": {"0": {name: {key: tensor}}}}``."""
    # the private loader format_utils.dcp_to_torch_save uses: dcp.load() copies the dict it is given,
    # and the planner that rebuilds the whole state fills the dict it sees
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    p = Path(path)
    _metadata(p)   # read safely first: a damaged or foreign .metadata gets its own error
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=_reader(p), planner=_planner(), no_dist=True)
    except CapsuleError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged or partial directory fails in many ways
        text = str(exc).strip().splitlines()
        raise CapsuleError(f"the sharded state in {short_path(p)} does not load ({type(exc).__name__}"
                           f"{': ' + text[-1][:160] if text else ''})", str(p),
                           "Copy the whole directory every rank wrote (each rank's __R_0.distcp file)") from None
    return state


def optimizer_state(meta: Mapping[str, Any], tensors: Mapping[str, Any], opt: torch.optim.Optimizer,
                    module: torch.nn.Module, where: str) -> dict[str, Any]:
    """A sharded capsule's optimizer state (keyed by parameter name) as ``opt.load_state_dict`` takes it
    for the entrypoint's unsharded model (keyed by the parameter's index in ``opt``'s groups)."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    groups = list(meta.get("param_groups") or [])
    if len(groups) != len(opt.param_groups):
        raise CapsuleError(f"the capsule's optimizer has {len(groups)} parameter group(s), the entrypoint's "
                           f"{len(opt.param_groups)}", where, "Return the optimizer of the guarded run")
    index: dict[str, int] = {}   # parameter name -> its index in opt's groups (names are distinct)
    out_groups = []
    for saved, live in zip(groups, opt.param_groups):
        live_names = [names.get(id(p)) for p in live["params"]]
        if list(saved.get("params") or []) != live_names:
            raise CapsuleError("the capsule's optimizer steps other parameters than the entrypoint's "
                               f"(group of {len(live_names)})", where,
                               "Return the same optimizer and parameter groups as the guarded run")
        out_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": [index.setdefault(n, len(index)) for n in live_names]})
    rest = meta.get("state") or {}
    state = {k: entry for n, k in index.items()
             if (entry := {**dict(rest.get(n) or {}), **dict(tensors.get(n) or {})})}
    return {"state": state, "param_groups": out_groups}


def read_dir(path: str | os.PathLike, read: Any) -> tuple[list, dict[str, Any]]:
    """Every rank's capsule of a capsule directory (rank order, each read with ``read``, capsule.io's) and its
    full state (see load_state).

    CapsuleError when the rank files disagree, when one is missing, or when the full state would not fit
    in this machine's memory."""
    p = Path(path)
    where = str(path)
    files = sorted((int(m.group(1)), q) for q in p.iterdir() if (m := RANK_FILE.match(q.name)))
    if not files:
        raise CapsuleError(f"{short_path(p)} is a directory without rank files", where,
                           "Give a capsule directory nanprobe wrote (stepNNNNNNN-...capsule/) or a capsule file")
    caps = [read(q) for _, q in files]
    first = caps[0]
    for (r, q), cap in zip(files, caps):
        if not isinstance(cap.data.get("sharded"), Mapping) or cap.data["sharded"].get("kind") != KIND:
            raise CapsuleError(f"{q.name} is not a sharded capsule's rank file", where, "Use another capsule")
        if cap.step != first.step or cap.world_size != first.world_size or cap.rank != r:
            raise CapsuleError(f"{q.name} is from another step or run (step {cap.step}, rank {cap.rank} of "
                               f"{cap.world_size})", where, "Use the directory as the guard wrote it")
    missing = sorted(set(range(first.world_size)) - {c.rank for c in caps})
    if missing:
        raise CapsuleError(f"the capsule lacks the file of rank(s) {', '.join(map(str, missing))} of "
                           f"{first.world_size}", where,
                           "Copy the whole directory: every rank writes its own rankR.pt and __R_0.distcp")
    # the state read in full, and the replay's own copy of it (restored between reruns); the entrypoint's
    # model is already allocated
    need, have = 2 * state_bytes(p), available_bytes()
    if have is not None and need > have:
        raise CapsuleError(f"the full model and optimizer state of this capsule need {need / 2**30:.1f} GiB of "
                           f"memory on one process (read in full, and the replay's copy to restore between reruns), "
                           f"{have / 2**30:.1f} GiB are available", where,
                           "Replay it on a machine with more memory (replaying it sharded under torchrun is not "
                           "supported yet)")
    return caps, load_state(p)

