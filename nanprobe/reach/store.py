"""Where a snapshot's tensors live while nanprobe needs them.

* ``device`` — clones beside the originals: fastest, costs the state's size in device memory;
  used for small states.
* ``host``  — copies in host memory, for CUDA runs: the GPU keeps only what training needs.
* ``disk``  — one file, for large CPU states: the process's memory stays what training needs.
  Tensors are written from and read back into the live tensors' own memory (no temporary copy,
  no fresh allocation), so a restore costs one read of the state.

A :class:`TensorStore` is refilled in place (``put`` over the same slots), so a rolling snapshot
taken every K steps reuses its buffers or its file instead of allocating again.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous CPU tensor's memory (no copy)."""
    return t.reshape(-1).view(torch.uint8)


@dataclass(slots=True)
class Slot:
    """One saved tensor: its place in the store and its layout."""

    store: TensorStore
    index: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    offset: int = 0          # disk: byte offset in the file
    nbytes: int = 0

    def load(self) -> torch.Tensor:
        """A fresh tensor holding the saved values, on the original device."""
        return self.store.load(self)

    def copy_into(self, live: torch.Tensor) -> None:
        """Write the saved values into ``live`` (same shape; dtype converted if it differs)."""
        self.store.copy_into(self, live)


class TensorStore:
    """A set of saved tensors in one place (see the module docstring)."""

    def __init__(self, mode: str, directory: str | None = None):
        if mode not in ("device", "host", "disk"):
            raise ValueError(mode)
        self.mode = mode
        self.directory = directory or None
        self._tensors: list[torch.Tensor | None] = []
        self._file = None
        self._path: str | None = None
        self._size = 0
        self._finalizer = None

    # -- writing --------------------------------------------------------------------------------------
    def put_all(self, tensors: Iterable[torch.Tensor], reuse: list[Slot] | None = None) -> list[Slot]:
        """Save ``tensors``; with ``reuse`` (the slots of an earlier put of the same layout) the same
        buffers / file region are overwritten instead of allocated."""
        tensors = list(tensors)
        if reuse is not None and len(reuse) == len(tensors) and all(
                s.shape == t.shape and s.dtype == t.dtype and s.device == t.device for s, t in zip(reuse, tensors)):
            for s, t in zip(reuse, tensors):
                if self.mode == "disk":
                    self._write(self._open(), t.detach(), s.offset)
                else:
                    self._tensors[s.index].copy_(t.detach())   # (the stored copy does not require grad)
            return reuse
        self._tensors, self._size = [], 0
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
        return [self._put(t) for t in tensors]

    def _put(self, t: torch.Tensor) -> Slot:
        t = t.detach()
        slot = Slot(store=self, index=len(self._tensors), shape=t.shape, dtype=t.dtype, device=t.device,
                    offset=self._size, nbytes=t.numel() * t.element_size())
        if self.mode == "device":
            self._tensors.append(t.clone())   # clone, not .to(copy=True): retarget_casts would rewrite its dtype
        elif self.mode == "host":
            self._tensors.append(t.to("cpu", copy=True))
        else:
            self._write(self._open(), t, slot.offset)
            self._size += slot.nbytes
            self._tensors.append(None)
        return slot

    def _open(self):
        if self._file is None:
            fd, path = tempfile.mkstemp(prefix="nanprobe-snapshot-", suffix=".bin", dir=self.directory)
            self._file = os.fdopen(fd, "w+b", buffering=0)
            self._path = path
            self._finalizer = weakref.finalize(self, _remove, self._file, path)
        return self._file

    @staticmethod
    def _write(f, t: torch.Tensor, offset: int) -> None:
        """In chunks through host memory, so no state-sized host buffer appears for a CUDA tensor."""
        f.seek(offset)
        flat = t.reshape(-1)
        step = max(1, (64 << 20) // t.element_size())
        for start in range(0, flat.numel(), step):
            f.write(memoryview(_as_bytes(flat[start:start + step].to("cpu")).numpy()))

    # -- reading --------------------------------------------------------------------------------------
    def load(self, slot: Slot) -> torch.Tensor:
        if self.mode == "device":
            return self._tensors[slot.index].clone()
        if self.mode == "host":
            return self._tensors[slot.index].to(slot.device, copy=True)
        out = torch.empty(slot.shape, dtype=slot.dtype, device="cpu")
        self._read_range(slot, out, 0)
        return out.to(slot.device) if slot.device.type != "cpu" else out

    def copy_into(self, slot: Slot, live: torch.Tensor) -> None:
        with torch.no_grad():
            if self.mode != "disk":
                live.copy_(self._tensors[slot.index])
            elif not live.is_contiguous():
                live.copy_(self.load(slot))
            elif live.device.type == "cpu" and live.dtype == slot.dtype:
                self._read_range(slot, live, 0)
            else:   # another device or dtype: through host memory in chunks
                flat, step = live.view(-1), max(1, (64 << 20) // slot.dtype.itemsize)
                for start in range(0, flat.numel(), step):
                    buf = torch.empty(min(step, flat.numel() - start), dtype=slot.dtype)
                    self._read_range(slot, buf, start)
                    flat[start:start + buf.numel()].copy_(buf)

    def _read_range(self, slot: Slot, out: torch.Tensor, start: int) -> None:
        f = self._open()
        f.seek(slot.offset + start * out.element_size())
        view = memoryview(_as_bytes(out).numpy())
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"snapshot file {self._path} is shorter than expected")
            got += n

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self._file = None


def _remove(f, path: str) -> None:
    try:
        f.close()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


__all__ = ["TensorStore", "Slot"]
