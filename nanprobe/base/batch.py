"""Walk nested batches (dicts, lists, tuples, dataclasses) with readable key paths."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def iter_tensors(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key_path, tensor)`` for every tensor in a nested batch, e.g. ``batch["ids"]``."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from iter_tensors(value, f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from iter_tensors(getattr(batch, f.name), f"{path}.{f.name}")
    elif isinstance(batch, (list, tuple)):
        fields_ = getattr(batch, "_fields", None)  # namedtuple
        for i, value in enumerate(batch):
            yield from iter_tensors(value, f"{path}.{fields_[i]}" if fields_ else f"{path}[{i}]")


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor], *,
                ragged: Callable[[list | tuple, bool], Any] | None = None, _top: bool = True) -> Any:
    """Rebuild a nested batch with ``fn`` applied to every tensor (containers are copied).

    ``ragged(items, top)``, where given, may rebuild a plain list or tuple itself (None: it does not)."""
    def inner(x: Any) -> Any:
        return map_tensors(x, fn, ragged=ragged, _top=False)

    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)((k, inner(v)) for k, v in batch.items())
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: inner(getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(inner(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        own = ragged(batch, _top) if ragged is not None else None
        return own if own is not None else type(batch)(inner(v) for v in batch)
    return batch


def clone_batch(batch: Any) -> Any:
    """A copy whose tensors the training step cannot mutate in place."""
    return map_tensors(batch, lambda t: t.detach().clone())


def key_name(path: str) -> str:
    """The last key of a path: ``batch["labels"]`` -> ``labels``."""
    tail = path.rsplit("[", 1)[-1].rsplit(".", 1)[-1]
    return tail.strip("]'\"")
