"""Context parallelism: attention over a sequence split between ranks, by all-gathered keys and
values as Llama 3's.

Each rank of a group holds a share of every sequence's tokens; inside
:class:`GatheredAttention` each `scaled_dot_product_attention` call attends this rank's queries
to the keys and values of every share.

The gather (:func:`gather_shares`) is differentiable: its backward sums the gradient over the
group and keeps this rank's share. When every rank computes a different part of the loss (a
language model's tokens), the summed gradients are those of one process; when every rank
computes the same loss (a flow model's whole velocity, gathered), they are the group size times
one process's, which averaging over the group takes back.

Used by world models (`flow.context_parallel`, which splits by whole frames and refuses masks)
and by policy replicas of language models on CPU (`policy.parallelize`: causal, with the mask
of the split's token order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["GatheredAttention", "gather_shares", "token_share"]

KEY = "policy.parallelism.cp_size"


class _GatherShares(torch.autograd.Function):
    """All-gather the shares of a group along `dim`; the backward sums the gradient over the
    group and returns this rank's share."""

    @staticmethod
    def forward(ctx: Any, share: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:  # type: ignore[override]
        size = dist.get_world_size(group)
        ctx.group, ctx.rank, ctx.size, ctx.dim = group, dist.get_rank(group), size, dim
        parts = [torch.empty_like(share) for _ in range(size)]
        dist.all_gather(parts, share.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank], None, None


def gather_shares(share: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """The shares of every rank of `group` side by side along `dim` (`share` itself without a
    group); differentiable (see the module docstring)."""
    return share if group is None else _GatherShares.apply(share, group, dim)


def token_share(tokens: int, group: dist.ProcessGroup) -> slice:
    """The contiguous slice of `tokens` this rank of `group` runs."""
    size = dist.get_world_size(group)
    share = tokens // size
    start = dist.get_rank(group) * share
    return slice(start, start + share)


class GatheredAttention(TorchFunctionMode):
    """Inside it, each `scaled_dot_product_attention` call gets the keys and values [..., N, D]
    of every rank of `group` (gathered along dim -2; the queries stay this rank's) and counts in
    `calls`.

    With `mask` ([queries, all keys] bool, True where a query sees a key, keys in the gathered
    order) it replaces each call's own mask and causal flag: a causal language model whose rows
    are right-padded, where causality is the only mask. Without, a call with a mask or a causal
    flag is refused (a flow model's self-attention sees every token).

    Cosmos 3's generator splits only its generated tokens: every rank holds the whole prompt.
    `prefix` is then the prompt's length, whose keys and values lead every call's and are alike
    on every rank (kept, not gathered), and `whole_causal` lets a causal call without a mask
    through untouched and uncounted (the prompt's own attention, whole on every rank)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        mask: Tensor | None = None,
        *,
        prefix: int = 0,
        whole_causal: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.mask = mask
        self.prefix = prefix
        self.whole_causal = whole_causal
        self.calls = 0

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = dict(zip(names, args, strict=False)) | kwargs
        if self.mask is not None:
            given["attn_mask"], given["is_causal"] = self.mask, False
        elif self.whole_causal and given.get("is_causal") and given.get("attn_mask") is None:
            return func(**given)
        elif given.get("attn_mask") is not None or given.get("is_causal"):
            raise ValueError(
                f"{KEY}: a self-attention with a mask or causal order cannot be split by frames"
            )
        self.calls += 1
        heads = given["query"].shape[-3]
        for name in ("key", "value"):
            part = given[name]
            if part.shape[-3] != heads:  # (grouped heads: alike on every rank, whatever the
                # caller chose, e.g. transformers repeats them only where it passes a mask)
                part = part.repeat_interleave(heads // part.shape[-3], dim=-3)
            if self.prefix:
                kept, part = part.split([self.prefix, part.shape[-2] - self.prefix], dim=-2)
                given[name] = torch.cat([kept, gather_shares(part, self.group, dim=-2)], dim=-2)
            else:
                given[name] = gather_shares(part, self.group, dim=-2)
        given.pop("enable_gqa", None)
        return func(**given)
