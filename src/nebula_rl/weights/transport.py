"""Broadcast full weights from the policy (rank 0 of a `WeightGroup`) to rollout replicas.

Both sides derive the same `BucketLayout` from their own named tensors: names sorted, tensors
grouped by their wire dtype (the `transfer_dtype` for floating tensors when given, else their own),
packed into flat buckets of about `bucket_bytes`. Nothing but a 6-number header travels besides
the buckets; the header carries a digest of the layout, so two sides that disagree (a renamed
parameter, another shape, another `transfer_dtype` or `bucket_bytes`) both raise
`LayoutMismatchError` instead of exchanging garbage or hanging.

Frozen tensors: the sender may name tensors that never change (`frozen`, e.g. the parameters the
policy does not train). They are sent on the first push of the sender (every receiver's first
push: a replica that joins gets a new group and a new sender) and left out of every later one;
the receiver then returns only the others, and what it copied the first time stays. The layout
puts the frozen tensors in buckets of their own, after the others, so a later push broadcasts a
prefix of the buckets. The sender tells the receivers which tensors are frozen when both are
built.

One push, in order:
  1. `WeightSender.push` (caller's thread) copies every tensor into persistent bucket buffers
     (`copy_`, with the dtype cast) and returns. The caller may then change its parameters.
  2. A background thread all-gathers the header (version, layout digest, checksum) and broadcasts
     the buckets as bytes. `PushHandle.wait()` returns its timings; the next `push` waits for it.
  3. `WeightReceiver.receive` (rollout side) takes part in both collectives and returns the version
     and views of its own persistent buffers, valid until its next `receive`.
Every receiver calls `receive` once per push: the controller tells both sides when a sync happens.

Over gloo the buckets are CPU tensors wherever the weights live: with GPU tensors (policy and
rollout sharing a GPU, `mode = "colocated_separated"`) `push` copies them to the buckets and
`receive_into` back to the GPU; `receive`'s views are CPU tensors.

Same host, gloo: the buckets travel through shared memory instead of the broadcast. The
sender snapshots into one of two persistent shared-memory bucket sets (alternating per push) and
only the header goes over the group; `receive` returns views straight into that set, so the
rollout's own copy into its model is the only other copy (two memcpys per push instead of a
copy, a TCP transfer and a copy). A set is reused two pushes later, and the sender's next push
waits for every receiver to come back for the previous header, so views stay valid until the
receiver's next `receive`. Both sides negotiate it when built (`shared.share`): the sender
offers files in `/dev/shm` with a random token, and shared memory is used only if every receiver
can read the token (another container on the same host cannot); the files are unlinked as soon
as all members mapped them, so nothing is left behind even if a process dies.

Simplifications, on purpose: full (unsharded) tensors only (mapping shards between parallel
layouts is a separate step); one sender; buffers are allocated once (a full copy of the weights in
the wire dtype on each side; reusing them avoids the slow first touch of fresh memory); the
optional checksum is a sum of the bytes as int32 words, which catches corruption and
misplacement between buckets, not a permutation inside one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
from torch import Tensor

from nebula_rl.weights.group import WeightGroup
from nebula_rl.weights.shared import share

__all__ = [
    "BucketLayout",
    "CorruptedPushError",
    "LayoutMismatchError",
    "PushHandle",
    "PushStats",
    "Slot",
    "WeightReceiver",
    "WeightSender",
]

NamedTensors = Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
"""A state dict or the output of `named_parameters()`; only names, shapes, dtypes define a layout."""

DEFAULT_BUCKET_BYTES = 64 << 20
_ALIGN_BYTES = 8  # every bucket's size is a multiple of 8 bytes, so it can be viewed as int32


class LayoutMismatchError(ValueError):
    """The members of a weight group derived different bucket layouts."""


class CorruptedPushError(ValueError):
    """A push arrived with another checksum than the sender computed (a transfer failure)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one named tensor lives in the flat buckets."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    """Wire dtype (the bucket's dtype)."""
    bucket: int
    offset: int
    """In elements of `dtype`, from the start of the bucket."""
    numel: int
    frozen: bool = False
    """Sent on the first push only (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """Deterministic packing of named tensors into flat, single-dtype buckets."""

    slots: tuple[Slot, ...]
    bucket_dtypes: tuple[torch.dtype, ...]
    bucket_numels: tuple[int, ...]
    digest: int
    """63-bit hash of everything above; equal on two sides iff their layouts are equal."""
    num_trainable_buckets: int
    """Buckets before the first one of frozen tensors (all of them when none is frozen)."""

    @classmethod
    def build(
        cls,
        named_tensors: NamedTensors,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transfer_dtype: torch.dtype | None = None,
        frozen: Collection[str] = (),
    ) -> BucketLayout:
        """Layout of `named_tensors`; a tensor larger than `bucket_bytes` gets a bucket alone.
        The `frozen` ones go into buckets of their own, after all the others."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, tensor in _items(named_tensors):
            if name in specs:
                raise ValueError(f"tensor name {name!r} appears twice")
            wire = (
                transfer_dtype
                if transfer_dtype is not None and tensor.is_floating_point()
                else tensor.dtype
            )
            specs[name] = (tuple(tensor.shape), wire)
        if not specs:
            raise ValueError("cannot build a weight layout from zero tensors")

        unknown = sorted(set(frozen) - set(specs))
        if unknown:
            raise ValueError(f"frozen names {unknown[:3]} are not among the tensors")
        slots: list[Slot] = []
        dtypes: list[torch.dtype] = []
        numels: list[int] = []
        num_trainable = None
        order = sorted(specs, key=lambda n: (n in frozen, str(specs[n][1]), n))
        for name in order:
            shape, dtype = specs[name]
            numel = _numel(shape)
            item = dtype.itemsize
            is_frozen = name in frozen
            if is_frozen and num_trainable is None:
                num_trainable = len(dtypes)
                dtypes.append(dtype)  # the first frozen tensor opens a bucket
                numels.append(0)
            open_bucket = bool(dtypes) and dtypes[-1] == dtype
            if not open_bucket or (numels[-1] > 0 and (numels[-1] + numel) * item > bucket_bytes):
                dtypes.append(dtype)
                numels.append(0)
            slots.append(Slot(name, shape, dtype, len(dtypes) - 1, numels[-1], numel, is_frozen))
            numels[-1] += numel
        # Pad each bucket to whole 8-byte words (zeros on both sides).
        numels = [
            -(-n * d.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES // d.itemsize  # ceil to 8 bytes
            for n, d in zip(numels, dtypes, strict=True)
        ]
        text = repr(
            ([(s.name, s.shape, str(s.dtype), s.bucket, s.offset, s.frozen) for s in slots], numels)
        )
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
        trainable = len(dtypes) if num_trainable is None else num_trainable
        return cls(tuple(slots), tuple(dtypes), tuple(numels), digest, trainable)

    @property
    def num_bytes(self) -> int:
        """Bytes on the wire of a full push (padding included)."""
        return self.bucket_bytes(len(self.bucket_numels))

    def bucket_bytes(self, num_buckets: int) -> int:
        """Bytes of the first `num_buckets` buckets (padding included)."""
        pairs = zip(self.bucket_numels[:num_buckets], self.bucket_dtypes[:num_buckets], strict=True)
        return sum(n * d.itemsize for n, d in pairs)

    def allocate(self, device: torch.device) -> tuple[list[Tensor], dict[str, Tensor]]:
        """Zeroed bucket buffers on `device` and a view per name into them."""
        buffers = [
            torch.zeros(n, dtype=d, device=device)
            for n, d in zip(self.bucket_numels, self.bucket_dtypes, strict=True)
        ]
        return buffers, self.views(buffers)

    def views(self, buffers: list[Tensor]) -> dict[str, Tensor]:
        """A view per name into `buffers` (laid out as this layout's buckets)."""
        return {
            s.name: buffers[s.bucket][s.offset : s.offset + s.numel].view(s.shape)
            for s in self.slots
        }


@dataclass(frozen=True, slots=True)
class PushStats:
    """What one push cost, measured on the sender."""

    version: int
    num_bytes: int
    snapshot_s: float
    """Copying into the bucket buffers in the caller's thread, the only part that blocks it
    (on CUDA: launching the copies)."""
    transfer_s: float
    """Header, optional checksum and bucket broadcasts, in the background thread."""


class PushHandle:
    """A push in flight: `wait()` blocks until all receivers got it, and re-raises its error."""

    def __init__(self, version: int, future: Future[PushStats]) -> None:
        self.version = version
        self._future = future

    def done(self) -> bool:
        """Whether the broadcast finished (successfully or not)."""
        return self._future.done()

    def wait(self) -> PushStats:
        """Block until the broadcast finished; raise what it raised."""
        return self._future.result()


class WeightSender:
    """Policy side (rank 0): snapshot weights into buckets, broadcast them in the background.

    `named_tensors` defines the layout (names, shapes, dtypes); it is not kept. With
    `transfer_dtype` (e.g. `torch.bfloat16`) floating tensors are cast during the snapshot.
    `frozen`: names sent on the first push only (see the module docstring).
    `checksum`: on which pushes the sender adds a checksum that receivers verify.
    `shared_memory`: offer shared-memory buckets (used when every receiver can map them; gloo
    only). Building a sender is a collective with the receivers' constructors.
    """

    def __init__(
        self,
        group: WeightGroup,
        named_tensors: NamedTensors,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transfer_dtype: torch.dtype | None = None,
        checksum: Literal["first", "always", "never"] = "first",
        shared_memory: bool = True,
        frozen: Collection[str] = (),
    ) -> None:
        if group.rank != 0:
            raise ValueError(f"the WeightSender must be rank 0 of its group, got rank {group.rank}")
        if checksum not in ("first", "always", "never"):
            raise ValueError(f"checksum must be 'first', 'always' or 'never', got {checksum!r}")
        self.group = group
        named = list(_items(named_tensors))
        frozen = _share_frozen(group, named, set(frozen))
        self.layout = BucketLayout.build(
            named, bucket_bytes=bucket_bytes, transfer_dtype=transfer_dtype, frozen=frozen
        )
        self.checksum = checksum
        # One bucket set per in-flight push; two when shared (see the module docstring).
        self._sets = _negotiate(group, self.layout, offer=shared_memory)
        self.shared_memory = len(self._sets) == 2
        self._set_views = [self.layout.views(buffers) for buffers in self._sets]
        self._num_pushes = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nebula-weight-sender")
        self._pending: PushHandle | None = None
        self._last_version: int | None = None
        self._frozen = frozenset(s.name for s in self.layout.slots if s.frozen)

    def push(self, named_tensors: NamedTensors, version: int) -> PushHandle:
        """Snapshot `named_tensors` as `version` and start broadcasting it; returns at once.

        Waits for the previous push first (and raises its error). Every name of the layout must be
        given exactly once, with its shape; after the first push the frozen ones may be left out
        (they are not sent). Versions must increase.
        """
        self.wait()
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"version must increase: got {version} after {self._last_version}")
        start = time.perf_counter()
        seen: set[str] = set()
        slot = self._num_pushes % len(self._sets)
        views = self._set_views[slot]
        num_buckets = len(self.layout.bucket_numels)
        if self._num_pushes > 0:  # every receiver has the frozen tensors already
            num_buckets = self.layout.num_trainable_buckets
            views = {n: v for n, v in views.items() if n not in self._frozen}
        with torch.no_grad():
            for name, tensor in _items(named_tensors):
                view = views.get(name)
                if view is None and name in self._frozen:
                    continue
                if view is None:
                    raise ValueError(f"tensor {name!r} is not in the weight layout")
                if tensor.shape != view.shape:
                    raise ValueError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, the layout has "
                        f"{tuple(view.shape)}"
                    )
                view.copy_(tensor)
                seen.add(name)
        if len(seen) != len(views):
            missing = sorted(set(views) - seen)
            raise ValueError(f"push is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        ready = None
        if self.group.device.type == "cuda":
            # The background thread's collectives must start after these copies.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.group.device))
        snapshot_s = time.perf_counter() - start
        with_checksum = self.checksum == "always" or (
            self.checksum == "first" and self._last_version is None
        )
        self._last_version = version
        self._num_pushes += 1
        future = self._executor.submit(
            self._send, version, slot, num_buckets, with_checksum, ready, snapshot_s
        )
        self._pending = PushHandle(version, future)
        return self._pending

    def wait(self) -> PushStats | None:
        """Block until the last push finished; its stats, or None when nothing was pushed."""
        return None if self._pending is None else self._pending.wait()

    def close(self) -> None:
        """Finish the pending push and stop the background thread (the group stays open)."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def _send(
        self,
        version: int,
        slot: int,
        num_buckets: int,
        with_checksum: bool,
        ready: torch.cuda.Event | None,
        snapshot_s: float,
    ) -> PushStats:
        start = time.perf_counter()
        if ready is not None:  # (current_stream takes the device: this thread's may differ)
            torch.cuda.current_stream(self.group.device).wait_event(ready)
        buffers = self._sets[slot][:num_buckets]
        check = _checksum(buffers) if with_checksum else 0
        header = [version, self.layout.digest, int(with_checksum), check, slot, num_buckets]
        _exchange_header(self.group, self.layout, header)
        if not self.shared_memory:
            _broadcast(self.group, buffers)
        num_bytes = self.layout.bucket_bytes(num_buckets)
        return PushStats(version, num_bytes, snapshot_s, time.perf_counter() - start)


class WeightReceiver:
    """Rollout side (rank > 0): receive each push into persistent buffers.

    Build it from the rollout model's own named tensors (e.g. its `state_dict()`, or a meta-device
    copy) with the sender's `bucket_bytes` and `transfer_dtype`; `shared_memory=False` declines
    the sender's shared-memory buckets (then they are broadcast).
    """

    def __init__(
        self,
        group: WeightGroup,
        named_tensors: NamedTensors,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transfer_dtype: torch.dtype | None = None,
        shared_memory: bool = True,
    ) -> None:
        if group.rank == 0:
            raise ValueError(
                "rank 0 of a weight group is the sender; a WeightReceiver needs rank > 0"
            )
        self.group = group
        named = list(_items(named_tensors))
        frozen = _share_frozen(group, named, set())
        self.layout = BucketLayout.build(
            named, bucket_bytes=bucket_bytes, transfer_dtype=transfer_dtype, frozen=frozen
        )
        self._sets = _negotiate(group, self.layout, offer=shared_memory)
        self.shared_memory = len(self._sets) == 2
        self._set_views = [self.layout.views(buffers) for buffers in self._sets]

    def receive(self, *, timeout: timedelta | None = None) -> tuple[int, dict[str, Tensor]]:
        """Block until the next push; its version and a view per name into this receiver's buffers
        (every name on the first push, the tensors that are not frozen on later ones).

        The views are overwritten by the next `receive`. `timeout` bounds the wait for the push
        to start (default: the group's timeout); the transfer itself uses the group's timeout.
        A timeout leaves the group unusable: rebuild it.
        """
        header = _exchange_header(
            self.group, self.layout, [-1, self.layout.digest, 0, 0, 0, 0], timeout
        )
        version, _, with_checksum, expected, slot, num_buckets = header
        buffers = self._sets[slot][:num_buckets]
        if not self.shared_memory:
            _broadcast(self.group, buffers)
        if with_checksum and (got := _checksum(buffers)) != expected:
            raise CorruptedPushError(
                f"weights of version {version} arrived corrupted on rank {self.group.rank}: "
                f"checksum {got} != sender's {expected}"
            )
        views = self._set_views[slot]
        if num_buckets < len(self.layout.bucket_numels):
            return version, {s.name: views[s.name] for s in self.layout.slots if not s.frozen}
        return version, dict(views)

    def receive_into(self, named_tensors: NamedTensors, *, timeout: timedelta | None = None) -> int:
        """`receive` and copy every tensor it brought into the same-named one of `named_tensors`
        (in place)."""
        version, received = self.receive(timeout=timeout)
        with torch.no_grad():
            for name, tensor in _items(named_tensors):
                if name in received:
                    tensor.copy_(received[name])
        return version


def _items(named_tensors: NamedTensors) -> Iterable[tuple[str, Tensor]]:
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _checksum(buffers: list[Tensor]) -> int:
    """Sum of all bytes read as int32 words, exact (int64 accumulation, no overflow per bucket)."""
    total = sum(int(b.view(torch.int32).sum(dtype=torch.int64)) for b in buffers)
    return total % (1 << 63)


def _share_frozen(
    group: WeightGroup, named: list[tuple[str, Tensor]], frozen: set[str]
) -> set[str]:
    """Rank 0's `frozen` names, on every member: a collective of the sender's and receivers'
    constructors. When the members hold different names, none is frozen (their layouts differ
    anyway, and the first push raises `LayoutMismatchError`)."""
    names = sorted(name for name, _ in named)
    digest = int.from_bytes(hashlib.sha256("\0".join(names).encode()).digest()[:8], "little") >> 1
    mine = torch.tensor([len(names), digest], dtype=torch.int64, device=group.device)
    rows = [torch.empty_like(mine) for _ in range(group.world_size)]
    group.pg.allgather(rows, mine, group.timeout).wait()
    if any(not torch.equal(row, mine) for row in rows):
        return set()
    flags = [name in frozen for name in names]
    mask = torch.tensor(flags, dtype=torch.uint8, device=group.device)
    group.pg.broadcast(mask, 0, group.timeout).wait()
    return {name for name, flag in zip(names, mask.tolist(), strict=True) if flag}


def _negotiate(group: WeightGroup, layout: BucketLayout, *, offer: bool) -> list[list[Tensor]]:
    """Every member's bucket sets: two shared-memory sets when all members (gloo, `offer`, the
    same layout) can map the sender's files (`shared.share`), else one private set for the
    broadcast. A collective: all members of the group call it once, sender and receivers alike."""
    sizes = [
        n * d.itemsize for n, d in zip(layout.bucket_numels, layout.bucket_dtypes, strict=True)
    ]
    files = share(group, sizes * 2, layout.digest, offer=offer)
    if files is None:
        return [layout.allocate(group.device)[0]]
    num = len(sizes)
    return [
        [
            b.view(d)
            for b, d in zip(files[i * num : (i + 1) * num], layout.bucket_dtypes, strict=True)
        ]
        for i in range(2)
    ]


def _exchange_header(
    group: WeightGroup, layout: BucketLayout, header: list[int], timeout: timedelta | None = None
) -> list[int]:
    """All-gather every member's header; raise on any layout disagreement; rank 0's header."""
    mine = torch.tensor(header, dtype=torch.int64, device=group.device)
    gathered = [torch.empty_like(mine) for _ in range(group.world_size)]
    group.pg.allgather(gathered, mine, group.timeout if timeout is None else timeout).wait()
    rows = [g.tolist() for g in gathered]
    bad = [rank for rank, row in enumerate(rows) if row[1] != layout.digest]
    if bad:
        raise LayoutMismatchError(
            f"weight group {group.rdzv.name!r}: rank(s) {bad} built a different weight layout "
            f"than rank {group.rank} (digest {layout.digest:#x}); sender and receivers must use the "
            "same tensor names, shapes, dtypes, transfer_dtype and bucket_bytes"
        )
    return rows[0]


def _broadcast(group: WeightGroup, buffers: list[Tensor]) -> None:
    """Broadcast every bucket from rank 0, as bytes (any dtype), all in flight at once."""
    works = [group.pg.broadcast(b.view(torch.uint8), 0, group.timeout) for b in buffers]
    for work in works:
        work.wait()
    if group.device.type == "cuda":
        # NCCL's wait() only orders streams; the sender must know the buffers are free again.
        torch.cuda.current_stream(group.device).synchronize()
