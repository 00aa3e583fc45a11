"""The processes of one replica (or of one SFT job): who is which rank, and their process group.

A replica of `tp_size * pp_size * dp_shard_size * ...` devices is that many processes, its ranks.
:func:`nebula_rl.launch.run_ranks` starts them on this host and hands each its place through the
usual variables (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`), plus `NEBULA_RANKS`: the
path of a file in a private temporary folder (mode 0700) where they meet. :func:`init_ranks`
builds the default process group on that `FileStore`: only processes of this user can open it,
unlike torchrun's rendezvous `TCPStore`, which listens on every interface without
authentication. (Under torchrun, `init_ranks` uses its `env://` rendezvous instead.)

On top of the default group, the ranks of a replica share a gloo group for control messages
(:func:`control_group`): rank 0 hands the commands it reads to the others as Python objects, also
when the default group is NCCL.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = [
    "RANKS_ENV",
    "Ranks",
    "broadcast_object",
    "close_ranks",
    "control_group",
    "cpu_threads",
    "init_ranks",
    "rank_env",
]

RANKS_ENV = "NEBULA_RANKS"
"""The FileStore path of the ranks started by :func:`nebula_rl.launch.run_ranks`."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of its replica."""

    rank: int
    local_rank: int
    world_size: int
    store_path: str | None
    """The FileStore the ranks meet in; None under torchrun (`env://`)."""


def rank_env() -> Ranks:
    """This process's place from its environment (rank 0 of 1 when started alone)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    return Ranks(rank, local_rank, world_size, os.environ.get(RANKS_ENV) or None)


def init_ranks(
    backend: Literal["gloo", "nccl"], *, timeout: timedelta = timedelta(minutes=10)
) -> Ranks:
    """Join the default process group of this replica's ranks (CUDA: on device `LOCAL_RANK`)."""
    ranks = rank_env()
    if backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
    if ranks.store_path is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = dist.FileStore(ranks.store_path, ranks.world_size)
        dist.init_process_group(
            backend, store=store, rank=ranks.rank, world_size=ranks.world_size, timeout=timeout
        )
    return ranks


_CONTROL: dist.ProcessGroup | None = None


def control_group() -> dist.ProcessGroup:
    """A gloo group of every rank (created once, by all ranks together): Python objects travel
    on it without touching the accelerator."""
    global _CONTROL
    if _CONTROL is None:
        _CONTROL = dist.new_group(backend="gloo")
    return _CONTROL


def broadcast_object(obj: Any, *, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank of the control group."""
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=control_group())
    return box[0]


def close_ranks() -> None:
    """Leave the ranks' groups (after a barrier, so no rank tears down a peer's pending work)."""
    global _CONTROL
    if not dist.is_initialized():
        return
    dist.barrier(group=control_group())
    _CONTROL = None
    dist.destroy_process_group()


@contextlib.contextmanager
def cpu_threads(count: int | None) -> Iterator[None]:
    """torch's CPU threads set to `count` for the block (None: unchanged). One process that
    both generates and trains (`--local`, a colocated world model) generates with
    `rollout.cpu_threads` and trains with `policy.cpu_threads`."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
