"""Tensor parallelism for the built-in engine (Megatron-style, as vLLM lays out Llama-family
models).

Per decoder layer, q/k/v and gate/up are split by output rows ("column parallel": each rank
computes its heads and its part of the MLP), o and down by input columns ("row parallel": each
rank's partial product is summed over the group, one all-reduce after attention and one after
the MLP). Norms, embeddings, the LM head and a vision-language model's vision tower (which runs once per
prompt, at admission) stay whole on every rank, so every rank computes the
same logits and, with the same seed, samples the same tokens: the ranks of a replica run the same
requests in lock step and any of them can report the results.

`shard_model` cuts a whole HF model's tensors in place (`param.data = slice.clone()`): the model
then holds only this rank's slices under the same names, and `boxes` says which slice of the full
tensor each name holds, for `weights.reshard.ShardedReceiver`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nebula_rl.weights.reshard import Box, chunk_box, full_box

__all__ = ["TensorParallel", "shard_model"]

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """The engine's tensor-parallel group: `size` ranks of one rollout replica."""

    group: dist.ProcessGroup | None
    """The torch.distributed group of the replica's ranks (None: the default world)."""
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> TensorParallel:
        """This process's rank and the size of `group` (torch.distributed must be initialised)."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place."""
        dist.all_reduce(x, group=self.group)
        return x


def _split_dim(name: str) -> int | None:
    """Which dimension of the full tensor `name` is split along (None: kept whole)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _COLUMN_PARALLEL + _ROW_PARALLEL:
        return None
    if "visual" in parts:  # a vision tower is small next to its LM: every rank keeps it whole
        return None
    if parts[-2] in _COLUMN_PARALLEL:
        return 0  # weight [out, in] and bias [out]: rows
    return 1 if parts[-1] == "weight" else None  # a row-parallel bias is added once, whole


def check_divisible(config: Any, size: int) -> None:
    """Raise a clear error unless the model's heads and MLP width split evenly in `size`."""
    config = config.get_text_config()  # (a vision-language model's language model)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": int(config.intermediate_size),
    }
    bad = {k: v for k, v in sizes.items() if v % size}
    if bad:
        raise ValueError(
            f"rollout.parallelism.tp_size = {size} must divide the model's {bad} "
            "(heads and MLP width are split evenly across the tensor-parallel ranks)"
        )


def shard_model(
    model: torch.nn.Module, tp: TensorParallel
) -> dict[str, tuple[tuple[int, ...], Box]]:
    """Keep only rank `tp.rank`'s slices of `model`'s parameters (in place, same names); per
    name, the full shape and the box this rank now holds."""
    check_divisible(model.config, tp.size)
    boxes: dict[str, tuple[tuple[int, ...], Box]] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            dim = _split_dim(name)
            if dim is None:
                boxes[name] = (shape, full_box(shape))
                continue
            box = chunk_box(shape, dim, tp.rank, tp.size)
            index = tuple(slice(lo, hi) for lo, hi in box)
            param.data = param.data[index].clone()
            boxes[name] = (shape, box)
    return boxes
