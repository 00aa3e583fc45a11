"""Log-probs and entropy of the target tokens, computed a chunk of positions at a time.

A model's logits are [B, L, V]; a float32 log-softmax of all of them, and an entropy built from
it, would hold several copies of that (GBs at a 150k vocabulary). Here only the positions the
loss reads (the masked ones) are taken, a chunk of them at a time: each chunk is cast to
`train.logprob_dtype`, log-softmaxed, and reduced to the sampled token's log-prob and, when
asked, the entropy. With gradients, every chunk is checkpointed (recomputed in backward), so no
more than one chunk's [tokens, V] float32 tensors exist at once in backward either. The entropy
carries gradient only when asked (an entropy bonus); otherwise it is computed under no_grad.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["LOGPROB_CHUNK_ELEMENTS", "logits_logprobs", "token_logprobs"]

LOGPROB_CHUNK_ELEMENTS = 2**26
"""Logits per chunk (tokens x vocabulary): 256 MiB in float32, ~450 tokens at a 150k vocabulary."""


def _chunk(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    dtype: torch.dtype,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
    """(log-prob of `targets` [n], entropy [n] or an empty tensor) of logits [n, V]."""
    z = logits.to(dtype)
    if temperature != 1.0:
        z = z / temperature
    logp = F.log_softmax(z, dim=-1)
    target_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return target_logp, logp.new_zeros(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return target_logp, entropy


def logits_logprobs(
    logits: Tensor,
    targets: Tensor,
    selected: Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    logprob_dtype: torch.dtype = torch.float32,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token, [B, T], and optionally the entropy [B, T], from logits
    [B, T, V] aligned with `targets` [B, T] (position t's logits score targets[:, t]).

    Args:
        selected: [B, T] bool: compute only there (0 elsewhere); None: everywhere.
        logprob_dtype: the logits are cast to it before the log-softmax (`train.logprob_dtype`).
        with_entropy: also return the entropy; `entropy_grad`: let it carry gradient.
        chunk_tokens: positions per chunk; None: `LOGPROB_CHUNK_ELEMENTS` // vocabulary.
    """
    if selected is None:
        selected = torch.ones_like(targets, dtype=torch.bool)
    flat_logits = logits[selected]  # [N, V], N = selected positions
    flat_targets = targets[selected]
    size = chunk_tokens or max(1, LOGPROB_CHUNK_ELEMENTS // logits.shape[-1])
    compute = functools.partial(
        _chunk,
        temperature=temperature,
        dtype=logprob_dtype,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    pieces = []
    for chunk, chunk_targets in zip(flat_logits.split(size), flat_targets.split(size), strict=True):
        if torch.is_grad_enabled() and chunk.requires_grad:
            pieces.append(
                checkpoint(
                    compute, chunk, chunk_targets, use_reentrant=False, preserve_rng_state=False
                )
            )
        else:
            pieces.append(compute(chunk, chunk_targets))
    zeros = torch.zeros(targets.shape, dtype=logprob_dtype, device=logits.device)
    logprobs = zeros.masked_scatter(selected, torch.cat([lp for lp, _ in pieces]))
    if not with_entropy:
        return logprobs, None
    entropy = zeros.masked_scatter(selected, torch.cat([ent for _, ent in pieces]))
    return logprobs, entropy


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    position_ids: Tensor | None = None,
    target_mask: Tensor | None = None,
    logprob_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each next token, [B, L-1], and optionally the per-position entropy [B, L-1].

    Position t holds log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) at `temperature`.
    `attention_mask` is [B, L] (1 on real tokens) or, for packed rows, a prepared [B, 1, L, L]
    mask that comes with their `position_ids` [B, L].

    Args:
        target_mask: [B, L-1]: compute only where it is nonzero (0 elsewhere); None: everywhere.
        logprob_dtype: the logits are cast to it before the log-softmax (`train.logprob_dtype`).
        compute_dtype: run the forward under `torch.autocast` to this dtype (mixed precision
            without FSDP); None runs it in the parameters' dtype.
        with_entropy: also return the entropy; `entropy_grad`: let it carry gradient.
        chunk_tokens: positions per chunk; None: `LOGPROB_CHUNK_ELEMENTS` // vocabulary.
    """
    autocast = (
        torch.autocast(input_ids.device.type, dtype=compute_dtype)
        if compute_dtype is not None
        else nullcontext()
    )
    with autocast:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).logits
    return logits_logprobs(
        logits[:, :-1],
        input_ids[:, 1:],
        None if target_mask is None else target_mask.bool(),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        logprob_dtype=logprob_dtype,
        chunk_tokens=chunk_tokens,
    )
