"""The plan of a resharded push: boxes (what slice of a tensor a rank holds or needs), their
intersections as pieces, the pieces packed into messages in one global order, and how members
agree on it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial

from nebula_rl.weights.group import WeightGroup
from nebula_rl.weights.transport import (
    LayoutMismatchError,
)

Box = tuple[tuple[int, int], ...]
"""A slice of a tensor: `(start, stop)` along every dimension of the full tensor."""

DEFAULT_BUCKET_BYTES = 32 << 20
_ALIGN = 8  # message payloads are padded to whole 8-byte words (checksummed as int32 pairs)


def full_box(shape: Iterable[int]) -> Box:
    """The box of a whole tensor of `shape`."""
    return tuple((0, int(size)) for size in shape)


def chunk_box(shape: Iterable[int], dim: int, rank: int, size: int) -> Box:
    """Rank `rank`'s box when dimension `dim` is split in `size` parts like `torch.chunk`
    (and DTensor's `Shard`): parts of ceil(n / size), the last ones shorter or empty."""
    box = list(full_box(shape))
    n = box[dim][1]
    part = -(-n // size)
    box[dim] = (min(rank * part, n), min((rank + 1) * part, n))
    return tuple(box)


def dtensor_box(tensor: DTensor) -> Box:
    """The box of the full tensor that this rank's local shard of `tensor` covers."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in tensor.placements):
        raise ValueError(f"a Partial DTensor holds no slice of its values: {tensor.placements}")
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple((o, o + s) for o, s in zip(offset, shape, strict=True))


@dataclass(frozen=True, slots=True)
class _Piece:
    """One tensor slice a member holds (sender) or needs (receiver)."""

    name: str
    shape: tuple[int, ...]
    box: Box
    dtype: str
    trainable: bool
    place: tuple[int, int, int] | None = None
    """A receiver's tensor in its memory: (storage, byte offset in it, bytes of that storage the
    receiver's tensors span), so that tensors sharing a storage (views of one fused tensor) keep
    their relative places in a shared-memory set. None: a storage of its own."""


@dataclass(frozen=True, slots=True)
class _Copy:
    """A sub-box of one tensor that moves from one sender to one receiver."""

    name: str
    src: tuple[slice, ...]
    """Index into the sender's local tensor."""
    dst: tuple[slice, ...]
    """Index into the receiver's local tensor."""
    shape: tuple[int, ...]
    numel: int
    trainable: bool


@dataclass(frozen=True, slots=True)
class _Message:
    """Copies packed back to back into one buffer of one wire dtype."""

    index: int
    src: int
    dst: int
    dtype: torch.dtype
    copies: tuple[_Copy, ...]
    payload_bytes: int
    """Bytes of the packed copies, padded to whole 8-byte words."""


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def _relative(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def _numel(box: Box) -> int:
    numel = 1
    for lo, hi in box:
        numel *= hi - lo
    return numel


def _split_rows(box: Box, max_numel: int) -> list[Box]:
    """`box` cut along its first dimension into boxes of at most `max_numel` elements (at least
    one row each: a single row larger than that stays whole)."""
    if not box or _numel(box) <= max_numel:
        return [box]
    (lo, hi), rest = box[0], box[1:]
    rows = max(1, max_numel // max(1, _numel(rest)))
    return [((r, min(r + rows, hi)), *rest) for r in range(lo, hi, rows)]


def _wire_dtype(dtype: str, transfer_dtype: torch.dtype | None) -> torch.dtype:
    native = getattr(torch, dtype.removeprefix("torch."))
    assert isinstance(native, torch.dtype)
    if transfer_dtype is not None and native.is_floating_point:
        return transfer_dtype
    return native


def _plan(
    holdings: list[list[_Piece]],
    num_senders: int,
    *,
    bucket_bytes: int,
    transfer_dtype: torch.dtype | None,
    trainable_only: bool,
) -> list[_Message]:
    """The messages of one push, in the global order every member runs them in."""
    held: dict[str, dict[Box, list[int]]] = {}
    for rank in range(num_senders):
        for piece in holdings[rank]:
            held.setdefault(piece.name, {}).setdefault(piece.box, []).append(rank)
    shapes = {p.name: p for rank in range(num_senders) for p in holdings[rank]}
    pairs: dict[tuple[int, int, torch.dtype], list[_Copy]] = {}
    for dst in range(num_senders, len(holdings)):
        for need in sorted(holdings[dst], key=lambda p: p.name):
            source = shapes.get(need.name)
            if source is None:
                raise LayoutMismatchError(f"the rollout needs {need.name!r}; no policy rank has it")
            if source.shape != need.shape:
                raise LayoutMismatchError(
                    f"{need.name!r} is {list(source.shape)} on the policy and "
                    f"{list(need.shape)} on the rollout"
                )
            if trainable_only and not source.trainable:
                continue
            wire = _wire_dtype(source.dtype, transfer_dtype)
            covered = 0
            for box, ranks in held[need.name].items():
                common = _intersect(box, need.box)
                if common is None:
                    continue
                covered += _numel(common)
                src = ranks[dst % len(ranks)]
                itemsize = wire.itemsize
                for part in _split_rows(common, max(1, bucket_bytes // itemsize)):
                    pairs.setdefault((src, dst, wire), []).append(
                        _Copy(
                            need.name,
                            _relative(part, box),
                            _relative(part, need.box),
                            tuple(hi - lo for lo, hi in part),
                            _numel(part),
                            source.trainable,
                        )
                    )
            if covered != _numel(need.box):
                raise LayoutMismatchError(
                    f"the policy's shards of {need.name!r} cover {covered} of the "
                    f"{_numel(need.box)} elements rollout rank {dst - num_senders} needs"
                )
    # Pack each pair's copies into messages, then interleave the pairs round-robin.
    per_pair: list[list[tuple[int, int, torch.dtype, list[_Copy]]]] = []
    for (src, dst, wire), copies in sorted(
        pairs.items(), key=lambda kv: (*kv[0][:2], str(kv[0][2]))
    ):
        messages: list[tuple[int, int, torch.dtype, list[_Copy]]] = []
        used = 0
        for copy in copies:
            size = copy.numel * wire.itemsize
            if not messages or (used > 0 and used + size > bucket_bytes):
                messages.append((src, dst, wire, []))
                used = 0
            messages[-1][3].append(copy)
            used += size
        per_pair.append(messages)
    ordered: list[_Message] = []
    for k in range(max((len(m) for m in per_pair), default=0)):
        for messages in per_pair:
            if k < len(messages):
                src, dst, wire, copies = messages[k]
                nbytes = sum(c.numel for c in copies) * wire.itemsize
                padded = -(-nbytes // _ALIGN) * _ALIGN
                ordered.append(_Message(len(ordered), src, dst, wire, tuple(copies), padded))
    return ordered


def _digest(messages: list[_Message]) -> int:
    text = repr(
        [(m.src, m.dst, str(m.dtype), [(c.name, c.shape) for c in m.copies]) for m in messages]
    )
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _allgather_json(group: WeightGroup, value: object) -> list[object]:
    """Every member's `value`, by rank (JSON over two all-gathers: lengths, then bytes)."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=group.device)
    lengths = [torch.empty_like(length) for _ in range(group.world_size)]
    group.pg.allgather(lengths, length, group.timeout).wait()
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=group.device)
    mine[: data.numel()] = data.to(group.device)
    rows = [torch.empty_like(mine) for _ in range(group.world_size)]
    group.pg.allgather(rows, mine, group.timeout).wait()
    return [
        json.loads(bytes(row[: int(n)].cpu().tolist()).decode())
        for row, n in zip(rows, lengths, strict=True)
    ]


def _encode(pieces: list[_Piece]) -> list[list[object]]:
    rows: list[list[object]] = []
    for p in pieces:
        place = None if p.place is None else list(p.place)
        rows.append([p.name, list(p.shape), [list(r) for r in p.box], p.dtype, p.trainable, place])
    return rows


def _decode(rows: list[list[object]]) -> list[_Piece]:
    pieces = []
    for name, shape, box, dtype, trainable, place in rows:
        assert isinstance(shape, list) and isinstance(box, list)
        assert place is None or isinstance(place, list)
        pieces.append(
            _Piece(
                str(name),
                tuple(int(s) for s in shape),
                tuple((int(r[0]), int(r[1])) for r in box),
                str(dtype),
                bool(trainable),
                None if place is None else (int(place[0]), int(place[1]), int(place[2])),
            )
        )
    return pieces


def _placements(tensors: Mapping[str, Tensor]) -> dict[str, tuple[int, int, int] | None]:
    """Per tensor, its `_Piece.place`: tensors viewing one storage form a group, spanning from
    the first byte any of them covers to the last. A non-contiguous tensor gets None."""
    spans: dict[int, tuple[int, int]] = {}
    where: dict[str, tuple[int, int]] = {}
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            continue
        storage = tensor.untyped_storage().data_ptr()
        start = int(tensor.storage_offset()) * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        lo, hi = spans.get(storage, (start, end))
        spans[storage] = (min(lo, start), max(hi, end))
        where[name] = (storage, start)
    groups = {storage: i for i, storage in enumerate(spans)}
    places: dict[str, tuple[int, int, int] | None] = {}
    for name in tensors:
        if name not in where:
            places[name] = None
            continue
        storage, start = where[name]
        lo, hi = spans[storage]
        places[name] = (groups[storage], start - lo, hi - lo)
    return places


def _checksum(payload: Tensor) -> int:
    """Sum of the payload's int32 words, as a non-negative int64."""
    return int(payload.view(torch.int32).sum(dtype=torch.int64)) % (1 << 63)
