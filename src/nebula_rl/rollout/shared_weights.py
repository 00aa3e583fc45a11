"""Named tensors in a shared-memory file, for vLLM workers that run in processes of their own.

A vLLM engine with tensor parallelism > 1 runs a worker process per rank. Handing them a weight
update as tensors would pickle the whole model into every worker's message queue. Instead the
rollout process copies the update into one file in `/dev/shm` (:class:`SharedWeights`) and sends
each worker its manifest only (names, offsets, shapes, dtypes: a few kB); each worker maps the
file (:func:`mapped_tensors`) and gives vLLM's loaders views of it, and those loaders copy only
the worker's own tensor-parallel slice (`narrow`, then `copy_`), so a worker reads its slices
and nothing else.

The file is created private to the user (mode 0600) and unlinked by the writer once the
workers have mapped it (:meth:`SharedWeights.unlink`): a crash leaves nothing behind in
`/dev/shm`, and the open mappings stay valid.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
from collections.abc import Iterable, Iterator

import torch

__all__ = ["Manifest", "SharedWeights", "mapped_tensors"]

Manifest = list[tuple[str, int, tuple[int, ...], str]]
"""(name, byte offset, shape, dtype name) of each tensor in the file."""

_ALIGN = 64


def _shm_folder() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class SharedWeights:
    """A shared-memory file laid out for `shapes` (name -> (shape, dtype)), written with
    :meth:`write` and described to readers by :attr:`manifest`."""

    def __init__(self, shapes: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        manifest: Manifest = []
        offset = 0
        for name, shape, dtype in shapes:
            manifest.append((name, offset, tuple(shape), str(dtype).removeprefix("torch.")))
            offset += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        self.manifest = manifest
        self.nbytes = max(offset, _ALIGN)
        fd, self.path = tempfile.mkstemp(prefix="nebula-vllm-weights-", dir=_shm_folder())
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._linked = True
        self._views = dict(_views(self._map, manifest))

    def write(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each named tensor into its place in the file."""
        for name, tensor in tensors:
            self._views[name].copy_(tensor.detach())

    def unlink(self) -> None:
        """Remove the file's name (mappings stay valid): once every reader has mapped it."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Unlink the file and drop this process's mapping."""
        self.unlink()
        self._views.clear()
        with contextlib.suppress(BufferError):  # (a view lives on somewhere: so does the mapping)
            self._map.close()


def _views(buffer: mmap.mmap, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    for name, offset, shape, dtype_name in manifest:
        dtype = getattr(torch, dtype_name)
        flat = torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=offset)
        yield name, flat.view(shape)


def mapped_tensors(path: str, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `manifest` as views of the file at `path`, mapped into this process (the
    mapping is released when the last view is dropped)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        buffer = mmap.mmap(fd, size, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return list(_views(buffer, manifest))
