"""Shared-memory buffers that every member of a weight group maps, negotiated over the group.

On one host over gloo, weights need not cross TCP: the sender writes them into files in
`/dev/shm` that every receiver has mapped, and only a short header goes over the group
(`transport.py` for full weights, `reshard/` for slices). `share` sets those files up:

1. Rank 0 creates the files under a random name, reserving their memory (`posix_fallocate`, so
   a full `/dev/shm` makes it decline now instead of a SIGBUS on a later write), plus a probe
   file holding a random token.
2. Every member that was asked to offer/accept (`offer`) and planned the same layout (`digest`)
   reads the token: another container, or a host that does not share `/dev/shm`, cannot, and
   declines. If anyone declines, nobody maps anything and the caller falls back to the group's
   send paths.
3. Everyone maps the files (a failure to map declines too), then all meet once more and every
   member unlinks them, on success and on failure alike: the pages live only as long as some
   process maps them, so nothing is left in `/dev/shm` when a process dies after building.
   (Rank 0 dying between creating the files and the first exchange is the one window that
   leaves them behind.)
"""

from __future__ import annotations

import contextlib
import os
import secrets

import torch
from torch import Tensor

from nebula_rl.weights.group import WeightGroup

__all__ = ["share"]

SHM_DIR = "/dev/shm"
_PREFIX = "nebula-weights-"


def share(group: WeightGroup, sizes: list[int], digest: int, *, offer: bool) -> list[Tensor] | None:
    """Zeroed uint8 buffers of `sizes` bytes in shared memory, mapped by every member of
    `group`, or None when shared memory does not apply (not gloo) or any member declines.

    A collective: every member calls it once, with `sizes` derived from the same plan whenever
    `digest` is equal. `offer` false declines (for tests and benchmarks of the fallback).
    """
    if group.backend != "gloo":  # NCCL moves GPU memory itself
        return None

    def gather(values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(group.world_size)]
        group.pg.allgather(rows, mine, group.timeout).wait()
        return [r.tolist() for r in rows]

    name_id = token = 0
    paths: list[str] = []
    created: list[str] = []
    mapped: list[Tensor] = []
    try:
        if group.rank == 0 and offer:
            name_id, token = secrets.randbits(62), secrets.randbits(62)
            try:
                _create(_paths(name_id, len(sizes)), token, sizes, created)
            except OSError:  # no /dev/shm, or not enough room in it: decline
                name_id = 0
        name_id, token, their_digest = gather([name_id, token, digest])[0]
        paths = _paths(name_id, len(sizes)) if name_id else []
        sees = bool(name_id) and offer and their_digest == digest
        if sees and group.rank != 0:
            try:
                with open(paths[0], "rb") as probe:
                    sees = int.from_bytes(probe.read(8), "little") == token
            except OSError:  # another container, or /dev/shm not shared
                sees = False
            # Map only files rank 0 made: `from_file` would create a missing one here.
            sees = sees and all(os.path.exists(path) for path in paths[1:])
        mapped_ok = False
        if all(row[0] for row in gather([int(sees)])):
            try:
                mapped = [
                    torch.from_file(path, shared=True, size=_file_size(n), dtype=torch.uint8)[:n]
                    for path, n in zip(paths[1:], sizes, strict=True)
                ]
                mapped_ok = True
            except RuntimeError:  # torch.from_file could not map a file: decline
                mapped = []
        shared = all(row[0] for row in gather([int(mapped_ok)]))
    finally:
        for path in paths + created:  # every member, success or failure: nothing is left behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return mapped if shared else None


def _file_size(size: int) -> int:
    return max(size, 8)  # an empty file cannot be mapped


def _paths(name_id: int, num_files: int) -> list[str]:
    """The probe file, then the data files."""
    prefix = os.path.join(SHM_DIR, f"{_PREFIX}{name_id:x}")
    return [f"{prefix}-probe"] + [f"{prefix}-{i}" for i in range(num_files)]


def _create(paths: list[str], token: int, sizes: list[int], created: list[str]) -> None:
    """The data files, their memory reserved, then the probe with `token` (written last: a member
    that reads the token sees every data file); each path goes to `created` once it exists."""
    for path, size in zip(paths[1:], sizes, strict=True):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        created.append(path)
        try:
            os.posix_fallocate(fd, 0, _file_size(size))
        finally:
            os.close(fd)
    fd = os.open(paths[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    created.append(paths[0])
    with os.fdopen(fd, "wb") as probe:
        probe.write(token.to_bytes(8, "little"))
