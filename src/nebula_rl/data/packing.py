"""Sequence packing for SFT: several conversations per row, each attending only to itself.

A packed row concatenates whole examples up to `max_length` tokens (`policy.model_max_length`).
Three tensors make the model treat every example as if it were alone in its row:

- segment ids [B, L]: 1, 2, ... for the examples of a row, 0 on the padding after them;
- position ids [B, L] that restart at 0 at every example, so rotary embeddings see the positions
  the example has unpacked;
- a block-diagonal causal mask [B, 1, L, L]: query q attends to key k iff both lie in the same
  segment and k <= q. Padding is a segment of its own, so no query row is fully masked.

Transformers (5.x) hands a 4-D attention mask to the attention function unchanged
(`masking_utils._preprocess_mask_arguments` returns early on `attention_mask.ndim == 4`).
SDPA takes it as booleans (True: attend); eager attention adds the mask to the scores, so it gets
the additive form. Flash-attention kernels take no dense mask and sliding-window layers would
get the full mask, so packing refuses those models rather than letting examples see each other.

Simplification: packing is greedy first-fit in the order given, so a batch's packing is
deterministic (resumed runs repeat it); it does not sort by length, which would pack tighter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ATTENTION_MASK_FORMS",
    "block_causal_mask",
    "first_fit",
    "packed_attention_mask",
    "segment_positions",
]


def first_fit(lengths: Sequence[int], *, max_length: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `max_length` tokens.

    Each item goes, in order, into the first row with room for it, or opens a new row; the
    indices within a row keep their order.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"example {i} has {n} tokens, more than max_length {max_length}")
        row = next((r for r, free in enumerate(room) if free >= n), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(max_length)
        rows[row].append(i)
        room[row] -= n
    return rows


def segment_positions(segment_ids: Tensor) -> Tensor:
    """Position ids [B, L] counting from 0 at the start of every segment of `segment_ids` [B, L]."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def block_causal_mask(segment_ids: Tensor) -> Tensor:
    """Boolean [B, 1, L, L] mask, True where query q may attend to key k: same segment, k <= q."""
    length = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    return (same & causal).unsqueeze(1)


def _additive(mask: Tensor) -> Tensor:
    # float32 even for bf16 models: eager adds it to the scores, the sum is promoted to float32
    # and softmaxed in float32 anyway, and finfo.min keeps every row finite.
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return bias.masked_fill(~mask, torch.finfo(torch.float32).min)


ATTENTION_MASK_FORMS: dict[str, Callable[[Tensor], Tensor]] = {
    "sdpa": lambda mask: mask,
    "eager": _additive,
}
"""How each attention implementation takes a boolean [B, 1, L, L] mask."""


def packed_attention_mask(segment_ids: Tensor, model_config: Any) -> Tensor:
    """The block-diagonal causal mask of `segment_ids` [B, L] in the form the model's attention
    implementation takes (see :data:`ATTENTION_MASK_FORMS`)."""
    implementation = model_config._attn_implementation
    if implementation not in ATTENTION_MASK_FORMS:
        raise ValueError(
            f"train.sequence_packing needs {' or '.join(ATTENTION_MASK_FORMS)} attention; the "
            f"model uses {implementation!r}, which takes no 4-D mask"
        )
    if "sliding_attention" in (getattr(model_config, "layer_types", None) or []):
        raise ValueError(
            "train.sequence_packing: the model has sliding-window layers, which would get the "
            "full block mask; turn packing off for it"
        )
    return ATTENTION_MASK_FORMS[implementation](block_causal_mask(segment_ids))
