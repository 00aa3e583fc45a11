"""The two ends of a resharded push: `ShardedSender` on every policy rank, `ShardedReceiver` on
every rank of a rollout replica (the design: `nebula_rl.weights.reshard`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Literal

import torch
from torch import Tensor
from torch.distributed import Work
from torch.distributed.tensor import DTensor

from nebula_rl.weights.group import WeightGroup
from nebula_rl.weights.reshard.layout import _shared_layout, _slot_view, _view_checksum, _Write
from nebula_rl.weights.reshard.plan import (
    DEFAULT_BUCKET_BYTES,
    Box,
    _allgather_json,
    _checksum,
    _decode,
    _digest,
    _encode,
    _Message,
    _Piece,
    _placements,
    _plan,
    dtensor_box,
    full_box,
)
from nebula_rl.weights.shared import share
from nebula_rl.weights.transport import (
    LayoutMismatchError,
    NamedTensors,
    PushHandle,
    PushStats,
    _items,
)

_HEADER_TAG, _ACK_TAG = 1, 2  # shared memory: the only messages between policy and rollout


class _Endpoint:
    """What senders and receivers share: the plan, the buffers, the header, the push loop."""

    def __init__(
        self,
        group: WeightGroup,
        num_senders: int,
        pieces: list[_Piece],
        *,
        bucket_bytes: int,
        transfer_dtype: torch.dtype | None,
        window: int,
        checksum: Literal["first", "always", "never"],
        shared_memory: bool,
        zero_copy: bool = False,
    ) -> None:
        if not 0 < num_senders < group.world_size:
            raise ValueError(
                f"num_senders must be in [1, {group.world_size - 1}] for a group of "
                f"{group.world_size}, got {num_senders}"
            )
        if bucket_bytes <= 0 or window < 1:
            raise ValueError(f"need bucket_bytes > 0 and window >= 1, got {bucket_bytes}, {window}")
        if checksum not in ("first", "always", "never"):
            raise ValueError(f"checksum must be 'first', 'always' or 'never', got {checksum!r}")
        self.group = group
        self.num_senders = num_senders
        self.checksum = checksum
        self.window = window
        rows = _allgather_json(group, [zero_copy, _encode(pieces)])
        holdings = [_decode(r[1]) for r in rows]  # type: ignore[index]
        plan = {
            mode: _plan(
                holdings,
                num_senders,
                bucket_bytes=bucket_bytes,
                transfer_dtype=transfer_dtype,
                trainable_only=mode,
            )
            for mode in (False, True)
        }
        self._plans = {
            mode: [m for m in msgs if group.rank in (m.src, m.dst)] for mode, msgs in plan.items()
        }
        self._digests = {mode: _digest(msgs) for mode, msgs in plan.items()}
        self._num_pushes = 0
        writes, slots, set_bytes = _shared_layout(plan[False], holdings, num_senders)
        sets = share(group, [set_bytes] * 2, self._digests[False], offer=shared_memory)
        self.shared_memory = sets is not None
        """Whether pushes go through shared memory (negotiated when built: all members or none)."""
        self.zero_copy = self.shared_memory and any(bool(r[0]) for r in rows)  # type: ignore[index]
        """Whether some receiver takes its tensors as views of the sets (then the sets hold
        what the receivers use, and at most one push is in flight)."""
        self._sets = sets or []
        rank = group.rank
        # What this member writes (a sender) or reads (a receiver), as views per set, built once.
        mine = [w for w in writes if w.src == rank or rank in w.readers]
        self._views: list[list[tuple[_Write, Tensor]]] = [
            [(w, _slot_view(s, w.slot)[w.copy.dst]) for w in mine] for s in self._sets
        ]
        self._slot_views: list[dict[str, Tensor]] = [
            {name: _slot_view(s, slot) for name, slot in slots.get(rank, {}).items()}
            for s in self._sets
        ]
        if self.shared_memory:
            self._buffers: list[Tensor] = []
            self._prefault()
        else:
            largest = max((m.payload_bytes for m in self._plans[False]), default=0)
            self._buffers = [
                torch.zeros(largest + 8, dtype=torch.uint8, device=group.device)
                for _ in range(min(window, max(1, len(self._plans[False]))))
            ]

    @property
    def peak_buffer_bytes(self) -> int:
        """Bytes of this member's private message buffers (none with shared memory)."""
        return sum(b.numel() for b in self._buffers)

    @property
    def shared_memory_bytes(self) -> int:
        """Bytes of the two shared-memory sets (0 without): the same pages for every member of
        the group, so count them once per group, not per member."""
        return sum(s.numel() for s in self._sets)

    def _prefault(self) -> None:
        """Touch this member's pages of both sets now, so that no push pays for page faults:
        a sender writes its own pieces (nobody reads them before its first push), a receiver
        reads one byte per page of its tensors."""
        page = 4096
        with torch.no_grad():
            for views in self._views:
                for write, view in views:
                    if write.src == self.group.rank:
                        view.zero_()
            for slot_views in self._slot_views:
                for view in slot_views.values():
                    data = view.reshape(-1).view(torch.uint8)
                    int(data[::page].sum()) + int(data[-1])

    def _exchange(self, head: list[int], timeout: timedelta | None) -> list[int]:
        """Send/recv pushes: all-gather every member's `head` (version, trainable_only,
        checksum?; -1 on receivers) and plan digests; check that the senders agree with rank 0
        and that everyone planned the same; rank 0's head."""
        row = [*head, self._digests[False], self._digests[True]]
        mine = torch.tensor(row, dtype=torch.int64, device=self.group.device)
        rows = [torch.empty_like(mine) for _ in range(self.group.world_size)]
        self.group.pg.allgather(rows, mine, timeout or self.group.timeout).wait()
        table = [r.tolist() for r in rows]
        first = table[0]
        disagree = [r for r in range(self.num_senders) if table[r][:3] != first[:3]]
        if disagree:
            raise ValueError(
                f"policy ranks {disagree} pushed (version, trainable_only, checksum) "
                f"{[table[r][:3] for r in disagree]}, policy rank 0 pushed {first[:3]}"
            )
        bad = [r for r, row in enumerate(table) if row[3:] != first[3:]]
        if bad:
            raise LayoutMismatchError(
                f"weight group {self.group.rdzv.name!r}: rank(s) {bad} planned a different "
                "resharding than rank 0 (tensor names, shapes, boxes, transfer_dtype or "
                "bucket_bytes differ)"
            )
        return first[:3]

    def _run(
        self, messages: list[_Message], tensors: Mapping[str, Tensor], with_checksum: bool
    ) -> None:
        """Send or receive this member's messages in the global order, `window` in flight."""
        rank = self.group.rank
        in_flight: deque[tuple[object, _Message, Tensor]] = deque()

        def finish() -> None:
            work, message, buffer = in_flight.popleft()
            work.wait()  # type: ignore[attr-defined]
            if message.dst == rank:
                self._unpack(message, buffer, tensors, with_checksum)

        for i, message in enumerate(messages):
            if len(in_flight) == len(self._buffers):
                finish()
            buffer = self._buffers[i % len(self._buffers)][: message.payload_bytes + 8]
            tag = message.index
            if message.src == rank:
                self._pack(message, buffer, tensors, with_checksum)
                work = self.group.pg.send([buffer], message.dst, tag)  # type: ignore[attr-defined]
            else:
                work = self.group.pg.recv([buffer], message.src, tag)  # type: ignore[attr-defined]
            in_flight.append((work, message, buffer))
        while in_flight:
            finish()

    @staticmethod
    def _pack(
        message: _Message, buffer: Tensor, tensors: Mapping[str, Tensor], check: bool
    ) -> None:
        payload = buffer[: message.payload_bytes]
        flat = payload.view(message.dtype)
        offset = 0
        with torch.no_grad():
            for copy in message.copies:
                flat[offset : offset + copy.numel].view(copy.shape).copy_(
                    tensors[copy.name][copy.src]
                )
                offset += copy.numel
        flat[offset:].zero_()
        buffer[message.payload_bytes :].view(torch.int64)[0] = _checksum(payload) if check else 0

    @staticmethod
    def _unpack(
        message: _Message, buffer: Tensor, tensors: Mapping[str, Tensor], check: bool
    ) -> None:
        payload = buffer[: message.payload_bytes]
        if check:
            expected = int(buffer[message.payload_bytes :].view(torch.int64)[0])
            if (got := _checksum(payload)) != expected:
                raise ValueError(
                    f"weights from policy rank {message.src} arrived corrupted (message "
                    f"{message.index}: checksum {got} != {expected})"
                )
        flat = payload.view(message.dtype)
        offset = 0
        with torch.no_grad():
            for copy in message.copies:
                tensors[copy.name][copy.dst].copy_(
                    flat[offset : offset + copy.numel].view(copy.shape)
                )
                offset += copy.numel


def _trainable(tensor: Tensor) -> bool:
    return bool(tensor.requires_grad) or not tensor.is_floating_point()


class ShardedSender(_Endpoint):
    """Policy side: every policy rank builds one (ranks `0..num_senders-1` of `group`).

    `named_tensors`: the policy's parameters as it holds them: DTensors (any placements but
    Partial) or plain tensors (taken as whole). Which are trainable is read from
    `requires_grad` now. `shared_memory=False` declines shared memory (then every member uses
    the group's send/recv). Building is a collective with the receivers.
    """

    def __init__(
        self,
        group: WeightGroup,
        named_tensors: NamedTensors,
        *,
        num_senders: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transfer_dtype: torch.dtype | None = None,
        window: int = 2,
        checksum: Literal["first", "always", "never"] = "first",
        shared_memory: bool = True,
    ) -> None:
        if group.rank >= num_senders:
            raise ValueError(f"rank {group.rank} is a receiver: senders are ranks < {num_senders}")
        pieces = []
        for name, tensor in _items(named_tensors):
            box = dtensor_box(tensor) if isinstance(tensor, DTensor) else full_box(tensor.shape)
            pieces.append(
                _Piece(name, tuple(tensor.shape), box, str(tensor.dtype), _trainable(tensor))
            )
        super().__init__(
            group,
            num_senders,
            pieces,
            bucket_bytes=bucket_bytes,
            transfer_dtype=transfer_dtype,
            window=window,
            checksum=checksum,
            shared_memory=shared_memory,
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nebula-reshard-sender")
        self._handles: deque[PushHandle] = deque()  # pushes not waited for yet, oldest first

    def push(
        self,
        named_tensors: NamedTensors,
        version: int,
        *,
        trainable_only: bool = False,
        timeout: timedelta | None = None,
    ) -> PushHandle:
        """Push this rank's slices of `named_tensors` (the same tensors, by name, the sender was
        built from) as `version`. All policy ranks call it together with the same arguments; the
        first push must not be `trainable_only`.

        With shared memory it waits for the push before the previous one (whose set this one
        overwrites; its error is raised here), copies the slices into this push's set, sends
        the headers (after summing the copied bytes when this push has a checksum) and returns:
        the caller may change its parameters at once. The handle's `wait()` returns once every
        rollout rank copied the push, and raises what failed (`timeout` bounds that wait).

        Without shared memory (NCCL, or a member declined) it waits for the previous push, then
        reads the live parameters, so it returns only when its messages are sent, with a
        finished handle.
        """
        if trainable_only and self._num_pushes == 0:
            raise ValueError("the first push must send every tensor (trainable_only=False)")
        with_checksum = self.checksum == "always" or (
            self.checksum == "first" and self._num_pushes == 0
        )
        if not self.shared_memory:
            self.wait()
            start = time.perf_counter()
            head = self._exchange([version, int(trainable_only), int(with_checksum)], timeout)
            self._run(self._plans[trainable_only], self._local(named_tensors), bool(head[2]))
            self._num_pushes += 1
            elapsed = time.perf_counter() - start
            done: Future[PushStats] = Future()
            done.set_result(PushStats(version, self._push_bytes(trainable_only), elapsed, 0.0))
            self._handles.append(PushHandle(version, done))
            return self._handles[-1]
        # The reuse rule: this set last held the push before the previous one, which every
        # rollout rank has copied out once its handle is done; with zero-copy receivers it
        # holds what they use until they take the previous push.
        while len(self._handles) >= (1 if self.zero_copy else 2):
            self._handles.popleft().wait()
        if self.zero_copy and self._num_pushes < 2:
            trainable_only = False  # each set's first push carries every tensor
        start = time.perf_counter()
        local = self._local(named_tensors)
        slot = self._num_pushes % 2
        with torch.no_grad():
            for write, view in self._views[slot]:
                if trainable_only and not write.copy.trainable:
                    continue
                source = local[write.copy.name][write.copy.src]
                if write.wire not in (source.dtype, view.dtype):
                    source = source.to(write.wire)  # (rounded as the wire dtype would)
                view.copy_(source)
        self._num_pushes += 1
        # The headers, in push order (gloo sends return at once; a checksum is summed first).
        sums = self._checksums(slot, trainable_only) if with_checksum else {}
        head = [version, int(trainable_only), int(with_checksum), slot]
        receivers = range(self.num_senders, self.group.world_size)
        headers = [torch.tensor([*head, sums.get(dst, 0)], dtype=torch.int64) for dst in receivers]
        sends = [
            self.group.pg.send([header], dst, _HEADER_TAG)  # type: ignore[attr-defined]
            for dst, header in zip(receivers, headers, strict=True)
        ]
        snapshot_s = time.perf_counter() - start
        future = self._executor.submit(
            self._await_acks, head, (sends, headers), snapshot_s, timeout
        )
        self._handles.append(PushHandle(version, future))
        return self._handles[-1]

    def wait(self) -> PushStats | None:
        """Block until every push is done (raising the first error); the last one's stats, or
        None when none was in flight."""
        stats = None
        while self._handles:
            stats = self._handles.popleft().wait()
        return stats

    def close(self) -> None:
        """Finish the pending pushes and stop the background thread (the group stays open)."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def abandon(self) -> None:
        """Stop taking pushes without waiting for the one in flight (its group is being left:
        the push ends with the group's failure or timeout)."""
        self._handles.clear()
        self._executor.shutdown(wait=False)

    @staticmethod
    def _local(named_tensors: NamedTensors) -> dict[str, Tensor]:
        with torch.no_grad():  # (to_local's autograd bookkeeping costs more than the call)
            return {
                name: t.to_local() if isinstance(t, DTensor) else t
                for name, t in _items(named_tensors)
            }

    def _await_acks(
        self,
        head: list[int],
        sent: tuple[list[Work], list[Tensor]],
        snapshot_s: float,
        timeout: timedelta | None,
    ) -> PushStats:
        """Background thread, shared memory: wait until every rollout rank reported that it
        copied the push (`sent`: the header sends, with their tensors kept alive until done)."""
        start = time.perf_counter()
        version, trainable_only = head[:2]
        receivers = range(self.num_senders, self.group.world_size)
        acks = [torch.zeros(2, dtype=torch.int64) for _ in receivers]
        works = [
            self.group.pg.recv([ack], dst, _ACK_TAG)  # type: ignore[attr-defined]
            for dst, ack in zip(receivers, acks, strict=True)
        ]
        for work in [*sent[0], *works]:
            work.wait(timeout or self.group.timeout)
        failed = [
            dst for dst, ack in zip(receivers, acks, strict=True) if ack.tolist() != [version, 1]
        ]
        if failed:
            raise RuntimeError(
                f"rollout rank(s) {[d - self.num_senders for d in failed]} failed to take "
                f"version {version} (see their error)"
            )
        return PushStats(
            version,
            self._push_bytes(bool(trainable_only)),
            snapshot_s,
            time.perf_counter() - start,
        )

    def _checksums(self, slot: int, trainable_only: bool) -> dict[int, int]:
        """Shared memory, per receiver: the checksum of the pieces of this push in set `slot`
        that this rank wrote and that receiver reads (a receiver sums the same per sender)."""
        sums: dict[int, int] = {}
        for write, view in self._views[slot]:
            if trainable_only and not write.copy.trainable:
                continue
            value = _view_checksum(view)
            for reader in write.readers:
                sums[reader] = (sums.get(reader, 0) + value) % (1 << 63)
        return sums

    def _push_bytes(self, trainable_only: bool) -> int:
        """Bytes this rank sends (without shared memory) or packs (with) per push."""
        if not self.shared_memory:
            return sum(m.payload_bytes for m in self._plans[trainable_only])
        return sum(
            view.numel() * view.element_size()
            for write, view in self._views[0]
            if not trainable_only or write.copy.trainable
        )


class ShardedReceiver(_Endpoint):
    """Rollout side: every rank of the receiving rollout replica builds one (ranks
    `num_senders..` of `group`).

    `named_tensors` are this rank's own tensors (e.g. a TP engine's parameter shards), written in
    place by `receive`; `boxes` gives, per name, the full tensor's shape and the box this rank
    holds (`TorchEngine.tp_boxes()`). `shared_memory=False` declines shared memory. Building is a
    collective with the senders.

    `zero_copy` (shared memory only; the tensors must be contiguous, and it applies only when
    they live on the group's device, the CPU: GPU tensors in a gloo group take copies from the
    CPU set instead): instead of copying a push
    out of the set, `receive` re-points `named_tensors` at it (`tensor.data = view`, the same
    tensor objects), laid out as they were: views of one storage (parts of a fused tensor) stay
    consecutive views of one block, so the owner can re-fuse them without a copy
    (`TorchEngine.update_weights_with` does). The policy then writes straight into what the
    rollout uses: one copy per push instead of two. The two sets take turns holding the
    receiver's weights, so the senders wait for each push to be taken before writing the next,
    and each set's first push carries every tensor. Without shared memory it receives in place.
    """

    def __init__(
        self,
        group: WeightGroup,
        named_tensors: Mapping[str, Tensor],
        boxes: Mapping[str, tuple[tuple[int, ...], Box]],
        *,
        num_senders: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transfer_dtype: torch.dtype | None = None,
        window: int = 2,
        shared_memory: bool = True,
        zero_copy: bool = False,
    ) -> None:
        if group.rank < num_senders:
            raise ValueError(f"rank {group.rank} is a sender: receivers are ranks >= {num_senders}")
        missing = sorted(set(named_tensors) ^ set(boxes))
        if missing:
            raise ValueError(
                f"named_tensors and boxes must name the same tensors; differ on {missing[:3]}"
            )
        # Tensors on another device than the group's buckets (GPU parameters in a gloo group,
        # mode = "colocated_separated") cannot become views of them: they take copies.
        zero_copy = zero_copy and all(t.device == group.device for t in named_tensors.values())
        places = _placements(named_tensors)
        if zero_copy and (strided := [n for n, place in places.items() if place is None]):
            raise ValueError(f"zero_copy needs contiguous tensors; {strided[:3]} are not")
        pieces = []
        for name, tensor in named_tensors.items():
            shape, box = boxes[name]
            if tuple(hi - lo for lo, hi in box) != tuple(tensor.shape):
                raise ValueError(
                    f"{name!r}: box {box} does not match its shape {tuple(tensor.shape)}"
                )
            pieces.append(
                _Piece(name, tuple(shape), tuple(box), str(tensor.dtype), True, places[name])
            )
        super().__init__(
            group,
            num_senders,
            pieces,
            bucket_bytes=bucket_bytes,
            transfer_dtype=transfer_dtype,
            window=window,
            checksum="never",  # the senders decide; their header says whether to verify
            shared_memory=shared_memory,
            zero_copy=zero_copy,
        )
        self._adopts = zero_copy and self.shared_memory
        self._tensors = dict(named_tensors)
        self._views_by_src: list[dict[int, list[tuple[_Write, Tensor]]]] = []
        for views in self._views:
            self._views_by_src.append({})
            for write, view in views:
                self._views_by_src[-1].setdefault(write.src, []).append((write, view))
        # Shared memory: the last acknowledgement (version, ok) and its sends, until sent.
        self._ack = torch.zeros(2, dtype=torch.int64)
        self._acks: list[Work] = []

    def receive(self, *, timeout: timedelta | None = None) -> int:
        """Wait for the next push and write it into this rank's tensors in place (zero-copy:
        re-point them at it); its version. `timeout` bounds the wait for the push to start."""
        if not self.shared_memory:
            version, trainable_only, with_checksum = self._exchange([-1, -1, -1], timeout)
            self._num_pushes += 1
            self._run(self._plans[bool(trainable_only)], self._tensors, bool(with_checksum))
            return version
        senders = range(self.num_senders)
        self.close()  # the previous push's acknowledgement, long sent by now
        rows = [torch.zeros(5, dtype=torch.int64) for _ in senders]
        works = [
            self.group.pg.recv([row], src, _HEADER_TAG)  # type: ignore[attr-defined]
            for src, row in zip(senders, rows, strict=True)
        ]
        heads: list[list[int]] = []
        ok = False
        try:
            # Each policy rank's pieces as soon as its header is in (they pack independently).
            for src, (work, row) in enumerate(zip(works, rows, strict=True)):
                work.wait(timeout or self.group.timeout)
                heads.append(row.tolist())
                self._take(src, heads[-1], heads[0])
            if self._adopts:  # every policy rank wrote its pieces: use the set as it is
                for name, view in self._slot_views[heads[0][3]].items():
                    self._tensors[name].data = view
            ok = True
        finally:  # once a push started, the senders learn how it went instead of timing out
            if heads:
                self._num_pushes += 1
                self._ack = torch.tensor([heads[0][0], int(ok)], dtype=torch.int64)
                self._acks = [
                    self.group.pg.send([self._ack], src, _ACK_TAG)  # type: ignore[attr-defined]
                    for src in senders
                ]
        return heads[0][0]

    def close(self) -> None:
        """Finish sending the last acknowledgement (shared memory); call it before leaving the
        group, so that the policy's last push does not fail. The group stays open."""
        for work in self._acks:
            work.wait(self.group.timeout)
        self._acks = []

    def _take(self, src: int, row: list[int], first: list[int]) -> None:
        """Check policy rank `src`'s header `row` against policy rank 0's (`first`), verify the
        checksum when asked, copy its pieces out of the set (unless zero-copy)."""
        if row[:4] != first[:4]:
            raise ValueError(
                f"policy rank {src} pushed (version, trainable_only, checksum, set) {row[:4]}, "
                f"policy rank 0 pushed {first[:4]}"
            )
        version, trainable_only, with_checksum, slot, checksum = row
        assert slot == self._num_pushes % 2, "sets alternate push by push"
        views = [
            (write, view)
            for write, view in self._views_by_src[slot].get(src, [])
            if not trainable_only or write.copy.trainable
        ]
        if with_checksum:
            got = 0
            for _, view in views:
                got = (got + _view_checksum(view)) % (1 << 63)
            if got != checksum:
                raise ValueError(
                    f"weights of version {version} from policy rank {src} arrived corrupted "
                    f"on rank {self.group.rank}: checksum {got} != {checksum}"
                )
        if self._adopts:
            return
        with torch.no_grad():
            for write, view in views:
                self._tensors[write.copy.name][write.copy.dst].copy_(view)
