"""The shared-memory sets of a same-host resharded push: one block per receiving storage, laid out
as the rollout ranks' own tensors, and the views and checksums over them."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from nebula_rl.weights.reshard.plan import _Copy, _Message, _numel, _Piece, _wire_dtype


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one receiver's whole local tensor lives in a shared-memory set."""

    offset: int
    """Bytes from the start of the set."""
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _Write:
    """One copy into a shared-memory set: sender `src` writes `copy` from its shard into the
    slot of a receiver's tensor; every rank of `readers` reads it (receivers with identical
    slots share them)."""

    src: int
    readers: tuple[int, ...]
    slot: _Slot
    copy: _Copy
    """`copy.src` indexes the sender's local tensor, `copy.dst` the slot's tensor."""
    wire: torch.dtype
    """The plan's wire dtype: a value is rounded through it when it is neither the sender's
    nor the receiver's dtype (`transfer_dtype`)."""


_BLOCK_ALIGN = 64  # bytes: every dtype stays aligned, and blocks do not share cache lines


def _shared_layout(
    messages: list[_Message], holdings: list[list[_Piece]], num_senders: int
) -> tuple[list[_Write], dict[int, dict[str, _Slot]], int]:
    """One shared-memory set, laid out like the receivers' own tensors: the writes of the full
    plan, each receiver's slots by tensor name, and the set's size in bytes.

    Each receiver storage (a fused tensor and its parts, or a tensor of its own) is one block
    with its tensors at their offsets in that storage, so a receiver can take its tensors as
    views of the set (`zero_copy`) and fused tensors stay fused. Receivers whose blocks are
    identical (the same names, boxes, offsets and dtypes: a tensor every TP rank keeps whole,
    the same TP rank of two replicas) share one block, written once.
    """
    size = 0
    blocks: dict[tuple[object, ...], int] = {}
    slots: dict[int, dict[str, _Slot]] = {}
    for dst in range(num_senders, len(holdings)):
        groups: dict[object, list[_Piece]] = {}
        for piece in holdings[dst]:
            group = ("own", piece.name) if piece.place is None else piece.place[0]
            groups.setdefault(group, []).append(piece)
        mine = slots.setdefault(dst, {})
        for pieces in groups.values():
            parts = [
                (p.name, p.box, 0 if p.place is None else p.place[1], _wire_dtype(p.dtype, None))
                for p in pieces
            ]
            first = pieces[0]
            span = (
                _numel(first.box) * parts[0][3].itemsize if first.place is None else first.place[2]
            )
            block = (span, tuple(parts))
            if block not in blocks:
                blocks[block] = size
                size += -(-span // _BLOCK_ALIGN) * _BLOCK_ALIGN
            for name, box, offset, dtype in parts:
                shape = tuple(hi - lo for lo, hi in box)
                mine[name] = _Slot(blocks[block] + offset, shape, dtype)
    writes: dict[tuple[object, ...], _Write] = {}
    for message in messages:
        for copy in message.copies:
            slot = slots[message.dst][copy.name]
            key = (slot.offset, tuple((s.start, s.stop) for s in copy.dst))
            seen = writes.get(key)
            if seen is None:
                writes[key] = _Write(message.src, (message.dst,), slot, copy, message.dtype)
            else:
                writes[key] = replace(seen, readers=(*seen.readers, message.dst))
    return list(writes.values()), slots, size


def _slot_view(buffer: Tensor, slot: _Slot) -> Tensor:
    """`slot` of the uint8 set `buffer`, viewed as its tensor's dtype and shape."""
    nbytes = math.prod(slot.shape) * slot.dtype.itemsize
    return buffer[slot.offset : slot.offset + nbytes].view(slot.dtype).view(slot.shape)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _view_checksum(view: Tensor) -> int:
    """Sum of the view's elements read as integers of their size (any strides), as a
    non-negative int64."""
    words = view.view(_SAME_SIZE_INT[view.element_size()])
    return int(words.sum(dtype=torch.int64)) % (1 << 63)
