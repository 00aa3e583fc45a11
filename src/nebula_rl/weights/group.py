"""Process groups between separately started processes, for moving weights.

A policy replica and the rollout replicas are started on their own (not by one `torchrun`), so
they cannot share torch.distributed's default world. Instead the controller hands each member a
`Rendezvous` (the address of a TCPStore, a group name and the group's size) plus its rank, and
every member calls `build_group`. The store is served either by rank 0 or, with
`Rendezvous.hosted`, by a long-lived third process (the controller, see `serve_store`), so that
no member has to run on the controller's host and the store outlives any member.

The group is a bare c10d backend (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU) used
through its own collective methods (`pg.broadcast(t, 0, timeout).wait()`): it is never registered
with torch.distributed's world, so `dist.broadcast(group=...)` does not apply to it.

Everything times out: joining waits at most `timeout` for all ranks (and names the ranks that did
not come), and every collective is given the same timeout. After a member dies the survivors build
a new group under a new `name` (e.g. `"weights-g2"`): keys live under a per-name prefix of the
store, and a process reuses the store it already holds for the same address, so rank 0 keeps
serving the rendezvous across generations.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Protocol, cast

import torch
from torch import Tensor
from torch.distributed import (
    DistNetworkError,
    DistStoreError,
    PrefixStore,
    ProcessGroupGloo,
    ReduceOp,
    Store,
    TCPStore,
    Work,
)

__all__ = ["Collectives", "Rendezvous", "WeightGroup", "build_group", "free_port", "serve_store"]

CommBackend = Literal["gloo", "nccl"]

# One TCPStore per (host, port) and process: rank 0 must not bind its port twice when a group is
# rebuilt, and the other ranks keep one connection per store.
_STORES: dict[tuple[str, int], TCPStore] = {}


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and under which name the members of one weight group meet."""

    host: str
    """Host of the TCPStore: rank 0's address, or the store server's when `hosted`."""
    port: int
    """TCP port of the TCPStore."""
    name: str
    """Group name, unique per generation of the group (keys are prefixed with it)."""
    world_size: int
    """Number of members, the sender (rank 0) included."""
    hosted: bool = False
    """The store is served by another process (`serve_store`); every member is a client."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"Rendezvous.world_size must be >= 1, got {self.world_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"Rendezvous.port must be in 1..65535, got {self.port}")
        if not self.name:
            raise ValueError("Rendezvous.name must not be empty")


class Collectives(Protocol):
    """The methods of a c10d backend (ProcessGroupGloo, ProcessGroupNCCL) that weights/ uses.

    (torch's type stubs declare them on ProcessGroup only, though backends have them too.)
    """

    def broadcast(self, tensor: Tensor, root: int, timeout: timedelta | None = None) -> Work: ...

    def allreduce(
        self, tensor: Tensor, op: ReduceOp.RedOpType, timeout: timedelta | None = None
    ) -> Work: ...

    def allgather(
        self, output_tensors: list[Tensor], input_tensor: Tensor, timeout: timedelta
    ) -> Work: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True, slots=True, eq=False)
class WeightGroup:
    """One member's handle on a weight group: the c10d backend plus what it was built from."""

    pg: Collectives
    """The c10d backend; call its collectives directly (`pg.broadcast(t, 0, timeout).wait()`)."""
    rdzv: Rendezvous
    """The rendezvous this group was built from."""
    rank: int
    """This member's rank; 0 is the sender."""
    backend: CommBackend
    """"gloo" (CPU tensors) or "nccl" (GPU tensors)."""
    timeout: timedelta
    """Timeout of joining and of every collective."""
    device: torch.device
    """Where the group's tensors live: CPU for gloo, this member's GPU for NCCL."""

    @property
    def world_size(self) -> int:
        """Number of members."""
        return self.rdzv.world_size

    def close(self) -> None:
        """Tear the backend down; the group is unusable afterwards."""
        self.pg.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_store(host: str, port: int) -> TCPStore:
    """Serve a TCPStore at `host:port` from this process, for groups whose `Rendezvous.hosted`
    is set; it lives as long as the returned object (or the process)."""
    store = TCPStore(host, port, None, True, timedelta(minutes=5), wait_for_workers=False)
    _STORES[(host, port)] = store
    return store


def _store(rdzv: Rendezvous, *, rank: int, timeout: timedelta) -> TCPStore:
    key = (rdzv.host, rdzv.port)
    store = _STORES.get(key)
    if store is None:
        # No wait_for_workers: the join check below waits per group, with its own timeout.
        master = rank == 0 and not rdzv.hosted
        store = TCPStore(rdzv.host, rdzv.port, None, master, timeout, wait_for_workers=False)
        _STORES[key] = store
    store.set_timeout(timeout)  # this generation's timeout, for gloo's own rendezvous too
    return store


def _join(store: Store, rdzv: Rendezvous, *, rank: int, timeout: timedelta) -> None:
    """Every rank announces itself and waits for all others, so a missing one can be named."""
    keys = [f"joined/{r}" for r in range(rdzv.world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
    except DistStoreError as err:  # the wait timed out
        try:
            missing = str([r for r, k in enumerate(keys) if not store.check([k])])
        except DistNetworkError:  # rank 0 gave up first and took the store with it
            missing = "unknown (the store host is gone)"
        raise TimeoutError(
            f"group {rdzv.name!r} at {rdzv.host}:{rdzv.port}: rank(s) {missing} of "
            f"{rdzv.world_size} did not join within {timeout.total_seconds():g}s"
        ) from err


def build_group(
    rdzv: Rendezvous,
    *,
    rank: int,
    backend: CommBackend = "gloo",
    timeout: timedelta = timedelta(minutes=5),
) -> WeightGroup:
    """Join the weight group `rdzv` as `rank`; blocks until all members joined or `timeout`.

    Rank 0 hosts the TCPStore at `rdzv.host:rdzv.port` unless `rdzv.hosted`. Raises `TimeoutError` naming the missing
    ranks when not all members join in time. For NCCL, call `torch.cuda.set_device` first.
    """
    if not 0 <= rank < rdzv.world_size:
        raise ValueError(f"rank must be in [0, {rdzv.world_size}), got {rank}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    store = PrefixStore(f"nebula_rl/weights/{rdzv.name}", _store(rdzv, rank=rank, timeout=timeout))
    _join(store, rdzv, rank=rank, timeout=timeout)
    pg: torch._C._distributed_c10d.Backend
    if backend == "gloo":
        device = torch.device("cpu")
        pg = ProcessGroupGloo(store, rank, rdzv.world_size, timeout)
    else:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        device = torch.device("cuda", torch.cuda.current_device())
        pg = ProcessGroupNCCL(store, rank, rdzv.world_size, opts)
        # Create the communicator now, while all members are known to be present.
        pg.eager_connect_single_device(device)
    return WeightGroup(cast(Collectives, pg), rdzv, rank, backend, timeout, device)
