"""Process groups between separately started processes, for moving weights.

A policy replica and the rollout replicas are started on their own (each its own ranks), so
they cannot share torch.distributed's default world. Instead each member gets a `Rendezvous` (a
group name, the group's size and where to meet) plus its rank, and calls `build_group`. In a job
the members meet in the job's Redis (`Rendezvous.redis`, a :class:`~nebula_rl.weights.store.
RedisStore`): it has the job's password, so no unauthenticated port can join a group, and it
outlives any member. Without Redis (tests, benchmarks) they meet at a TCPStore served by rank 0
or, with `Rendezvous.hosted`, by a long-lived third process (`serve_store`).

The group is a bare c10d backend (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU; gloo
also on GPUs that policy and rollout share: :func:`weight_backend`) used
through its own collective methods (`pg.broadcast(t, 0, timeout).wait()`): it is never registered
with torch.distributed's world, so `dist.broadcast(group=...)` does not apply to it.

Everything times out: joining waits at most `timeout` for all ranks (and names the ranks that did
not come), and every collective is given the same timeout. After a member dies the survivors build
a new group under a new `name` (e.g. `"weights-g2"`): keys live under a per-name prefix of the
store, and a process reuses the store it already holds for the same address, so rank 0 keeps
serving the rendezvous across generations.

Elastic groups: the controller describes each generation of a group with a :class:`Generation`
(its number, its members in rank order); every member builds the group of that generation with
:meth:`Generation.rendezvous` in the job's Redis, and `build_group(cancelled=...)` gives up as
soon as a newer generation supersedes the one being joined. A group is left with
:func:`leave_group`: gloo closes its connections only when the backend object is destroyed, and
only then do peers blocked in a collective with this member fail at once instead of at their
timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol, cast

import redis
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

from nebula_rl.utils.net import bind_socket, free_port

__all__ = [
    "Collectives",
    "Generation",
    "GroupCancelled",
    "Rendezvous",
    "WeightGroup",
    "build_group",
    "free_port",
    "gloo_address",
    "leave_group",
    "serve_store",
    "weight_backend",
]

CommBackend = Literal["gloo", "nccl"]

# One store per address and process: rank 0 must not bind a TCPStore port twice when a group is
# rebuilt, the other ranks keep one connection per store, and a RedisStore's Python object must
# outlive the groups built on it.
_STORES: dict[tuple[Any, ...], Store] = {}
_STORES_LOCK = threading.Lock()
"""Held while the cache is read and filled: two threads building groups at once (trajectory
transfers) must not each make a store, one of which would be dropped while in use."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and under which name the members of one weight group meet."""

    host: str
    """Host of the TCPStore: rank 0's address, or the store server's when `hosted` ("" with
    `redis`)."""
    port: int
    """TCP port of the TCPStore (0 with `redis`)."""
    name: str
    """Group name, unique per generation of the group (keys are prefixed with it)."""
    world_size: int
    """Number of members, the sender (rank 0) included."""
    hosted: bool = False
    """The store is served by another process (`serve_store`); every member is a client."""
    redis: redis.Redis | None = field(default=None, compare=False)
    """Meet in this Redis server (the job's) instead of a TCPStore."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"Rendezvous.world_size must be >= 1, got {self.world_size}")
        if self.redis is None and not 0 < self.port < 65536:
            raise ValueError(f"Rendezvous.port must be in 1..65535, got {self.port}")
        if not self.name:
            raise ValueError("Rendezvous.name must not be empty")

    @property
    def where(self) -> str:
        """The store's address, for messages."""
        if self.redis is not None:
            kwargs = self.redis.connection_pool.connection_kwargs
            return f"redis {kwargs.get('host', kwargs.get('path', '?'))}:{kwargs.get('port', '')}"
        return f"{self.host}:{self.port}"


class GroupCancelled(RuntimeError):
    """Joining a group was abandoned because a newer generation replaced it."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation of an elastic group, as the controller publishes it: who is in it (rank =
    position in `members`) and where its members meet. A membership change makes a new one."""

    kind: str
    """Which group: "policy" (data parallel between policy replicas) or "weights"."""
    number: int
    """Generation number, increasing over the job (never reused, also across controller restarts)."""
    members: tuple[str, ...]
    """Replica names in rank order; for "weights" the sender comes first."""
    sizes: tuple[int, ...]
    """Processes of each member (its ranks), in member order."""
    job: str
    """Job name, part of the group name so that two jobs never share keys."""

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Generation:
        """A generation from the controller's JSON record (see `JobState.group_record`)."""
        return cls(
            kind=str(record["kind"]),
            number=int(record["generation"]),
            members=tuple(record["members"]),
            sizes=tuple(int(record.get("sizes", {}).get(m, 1)) for m in record["members"]),
            job=str(record["job"]),
        )

    @property
    def world_size(self) -> int:
        """Number of member replicas."""
        return len(self.members)

    @property
    def num_processes(self) -> int:
        """Ranks of the generation's group: every process of every member."""
        return sum(self.sizes)

    def rank_of(self, name: str) -> int | None:
        """`name`'s position among the members (its replica rank), None if it is not one."""
        return self.members.index(name) if name in self.members else None

    def first_rank(self, name: str) -> int:
        """The group rank of member `name`'s process 0 (its processes' ranks follow)."""
        position = self.members.index(name)
        return sum(self.sizes[:position])

    def size_of(self, name: str) -> int:
        """Processes of member `name`."""
        return self.sizes[self.members.index(name)]

    def rendezvous(self, store: redis.Redis, *, part: str = "") -> Rendezvous:
        """Where this generation's members build their group: in the job's Redis `store`, under
        a fresh key prefix per generation. The group has one rank per process of every member;
        with `part` (e.g. "l1"), a group of its own for that name, of one rank per member
        replica (the policy replicas' data-parallel group of their processes 1)."""
        name = f"{self.job}-{self.kind}-g{self.number}" + (f"-{part}" if part else "")
        size = self.world_size if part else self.num_processes
        return Rendezvous("", 0, name, size, redis=store)


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
        """Tear the backend down; the group is unusable afterwards (see :func:`leave_group` to
        also close the connections)."""
        self.pg.shutdown()


def weight_backend(mode: str, device: torch.device) -> CommBackend:
    """The backend of the weight group between policy and rollout replicas of a job in `mode`
    (the config's `mode`) whose member holds its weights on `device`: NCCL on GPUs, except with
    `mode = "colocated_separated"`, where a policy and a rollout process share each GPU and
    NCCL refuses two ranks on one device ("Duplicate GPU detected"); gloo then moves the weights
    through CPU buckets (shared memory on one host), copied from and to the GPU parameters."""
    if device.type != "cuda" or mode == "colocated_separated":
        return "gloo"
    return "nccl"


def leave_group(group: WeightGroup | None) -> None:
    """Shut `group` down, ignoring errors of a group that is already broken.

    Drop every reference to it afterwards (then `gc.collect()` for reference cycles): gloo closes
    its connections only when the backend object is destroyed, and only then do peers blocked in
    a collective with this member fail at once instead of at their timeout.
    """
    if group is not None:
        with contextlib.suppress(RuntimeError):
            group.close()


def _listen(host: str, port: int) -> int:
    """A socket listening on `host:port` only, as a file descriptor the TCPStore takes over.

    (TCPStore's own server listens on every interface whatever host it is given, which would put
    an unauthenticated store on the network of a job that was told to stay on loopback.)
    """
    return bind_socket(host, port, backlog=512).detach()


def _serve(host: str, port: int, timeout: timedelta) -> TCPStore:
    return TCPStore(
        host,
        port,
        None,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=_listen(host, port),
        use_libuv=True,
    )


def serve_store(host: str, port: int) -> TCPStore:
    """Serve a TCPStore at `host:port` (listening on `host` only) from this process, for groups
    whose `Rendezvous.hosted` is set; it lives as long as the returned object (or the process)."""
    store = _serve(host, port, timedelta(minutes=5))
    _STORES[(host, port)] = store
    return store


def _store(rdzv: Rendezvous, *, rank: int, timeout: timedelta) -> Store:
    with _STORES_LOCK:
        return _cached_store(rdzv, rank=rank, timeout=timeout)


def _cached_store(rdzv: Rendezvous, *, rank: int, timeout: timedelta) -> Store:
    if rdzv.redis is not None:
        kwargs = rdzv.redis.connection_pool.connection_kwargs
        key: tuple[Any, ...] = ("redis", *(kwargs.get(k) for k in ("host", "port", "path", "db")))
        store = _STORES.get(key)
        if store is None:
            from nebula_rl.weights.store import RedisStore

            store = _STORES[key] = RedisStore(rdzv.redis, prefix="nebula_rl/groups/")
        store.set_timeout(timeout)
        return store
    key = (rdzv.host, rdzv.port)
    store = _STORES.get(key)
    if store is None:
        # No wait_for_workers: the join check below waits per group, with its own timeout.
        if rank == 0 and not rdzv.hosted:
            store = _serve(rdzv.host, rdzv.port, timeout)
        else:
            store = TCPStore(rdzv.host, rdzv.port, None, False, timeout, wait_for_workers=False)
        _STORES[key] = store
    store.set_timeout(timeout)  # this generation's timeout, for gloo's own rendezvous too
    return store


_CANCEL_POLL_S = 0.05


def _join(
    store: Store,
    rdzv: Rendezvous,
    *,
    rank: int,
    timeout: timedelta,
    cancelled: Callable[[], bool] | None = None,
) -> None:
    """Every rank announces itself and waits for all others, so a missing one can be named.

    With `cancelled`, the wait polls the store and is abandoned (`GroupCancelled`) once
    `cancelled()` is true (asked twice a second). Whether the group goes ahead is then decided
    once for all ranks (:func:`_decide`): a rank that gives up after its peers saw every rank
    announced (its own key stays in the store) must not leave them building the backend
    without it until the timeout.
    """
    keys = [f"joined/{r}" for r in range(rdzv.world_size)]
    store.set(keys[rank], "1")
    deadline = time.monotonic() + timeout.total_seconds()
    next_ask = time.monotonic() + 0.5
    try:
        if cancelled is None:
            store.wait(keys, timeout)
            return
        # (polled: a store wait that times out logs a warning per slice)
        while not store.check(keys):
            now = time.monotonic()
            if now >= deadline:
                if _decide(store, _TIMED_OUT) == _GO:
                    return  # (every rank had joined just now: the group goes ahead)
                raise DistStoreError("timed out")
            if now >= next_ask:
                next_ask = now + 0.5
                if cancelled() and _decide(store, _CANCELLED) != _GO:
                    raise GroupCancelled(
                        f"group {rdzv.name!r}: a newer generation replaced it while joining"
                    )
            time.sleep(_CANCEL_POLL_S)
        outcome = _decide(store, _GO)
        if outcome == _TIMED_OUT:
            raise TimeoutError(
                f"group {rdzv.name!r} at {rdzv.where}: a peer's wait for the "
                f"{rdzv.world_size} ranks to join ended at its timeout first"
            )
        if outcome != _GO:
            raise GroupCancelled(f"group {rdzv.name!r}: a peer gave up joining it")
    except DistStoreError as err:  # the wait timed out
        try:
            missing = str([r for r, k in enumerate(keys) if not store.check([k])])
        except DistNetworkError:  # rank 0 gave up first and took the store with it
            missing = "unknown (the store host is gone)"
        raise TimeoutError(
            f"group {rdzv.name!r} at {rdzv.where}: rank(s) {missing} of "
            f"{rdzv.world_size} did not join within {timeout.total_seconds():g}s"
        ) from err


_OUTCOME = "joined/outcome"
_GO, _CANCELLED, _TIMED_OUT = "go", "cancelled", "timed out"


def _decide(store: Store, proposal: str) -> str:
    """Settle whether the group being joined goes ahead, the same for every rank: the first
    proposal stored wins (`_GO` from a rank that saw every rank announced, else a rank's giving
    up); returns the outcome."""
    return bytes(store.compare_set(_OUTCOME, "", proposal)).decode()


def gloo_address(rdzv: Rendezvous) -> str | None:
    """The local address a gloo member of `rdzv` listens on and gives its peers: the one this
    host reaches the rendezvous from (the job's Redis, or the TCPStore's host), so that members
    on other hosts can connect back; on one host (a rendezvous on loopback) that is loopback, so
    the group's sockets listen on no network interface. None leaves the choice to gloo, which
    takes `GLOO_SOCKET_IFNAME`'s interface when it is set (set it to choose yourself), else the
    address the host name resolves to: a public interface on one host, and across hosts an
    address its peers may not reach (Debian's 127.0.1.1, a network namespace)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    if rdzv.redis is not None:
        kwargs = rdzv.redis.connection_pool.connection_kwargs
        host, port = kwargs.get("host"), int(kwargs.get("port") or 6379)
    else:
        host, port = rdzv.host, rdzv.port
    if not host:  # (a Unix socket)
        return None
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)  # (UDP: picks the route, sends nothing)
            local = str(probe.getsockname()[0])
    except OSError:
        return None
    return local


def build_group(
    rdzv: Rendezvous,
    *,
    rank: int,
    backend: CommBackend = "gloo",
    timeout: timedelta = timedelta(minutes=5),
    cancelled: Callable[[], bool] | None = None,
) -> WeightGroup:
    """Join the weight group `rdzv` as `rank`; blocks until all members joined or `timeout`.

    Rank 0 hosts the TCPStore at `rdzv.host:rdzv.port` unless `rdzv.hosted`. Raises `TimeoutError`
    naming the missing ranks when not all members join in time, and `GroupCancelled` when
    `cancelled()` turns true while waiting (it is asked twice a second). For NCCL, call
    `torch.cuda.set_device` first.
    """
    if not 0 <= rank < rdzv.world_size:
        raise ValueError(f"rank must be in [0, {rdzv.world_size}), got {rank}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    store = PrefixStore(f"nebula_rl/weights/{rdzv.name}", _store(rdzv, rank=rank, timeout=timeout))
    _join(store, rdzv, rank=rank, timeout=timeout, cancelled=cancelled)
    pg: torch._C._distributed_c10d.Backend
    if backend == "gloo":
        device = torch.device("cpu")
        address = gloo_address(rdzv)
        if address is None:
            pg = ProcessGroupGloo(store, rank, rdzv.world_size, timeout)
        else:
            options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=address)]
            pg = ProcessGroupGloo(store, rank, rdzv.world_size, options)
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
