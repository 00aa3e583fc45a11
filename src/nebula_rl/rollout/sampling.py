"""Batched token sampling on the device, one call per step for the whole batch.

Sampling is by inverse CDF: each sequence owns a stream of uniforms drawn when it is admitted
(from its own seeded generator when the request has a seed), and a token is the first index where
the cumulative probability exceeds the uniform. That is exact categorical sampling, needs one
random number per sequence per step instead of one per vocabulary entry (the Gumbel/exponential
trick), and makes a seeded completion independent of what else is in the batch.

The returned log-probs are of the distribution the token was drawn from: repetition-penalised,
temperature-scaled, top-k/top-p-restricted, renormalised. Greedy rows (temperature 0) take the
argmax and report the log-prob at temperature 1 under the same penalty and restriction.

The repetition penalty is CTRL's (Keskar et al. 2019), as in HF and vLLM: the logit of a token
already in the sequence (prompt or completion) is divided by the penalty when positive and
multiplied by it when negative, before the temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BatchSampling:
    """Per-row sampling parameters of one step, as device tensors of shape [B]."""

    inv_temperature: torch.Tensor
    """1 / temperature (1 for greedy rows), float32."""
    top_k: torch.Tensor
    """Number of tokens kept (vocab size when off), int64."""
    top_p: torch.Tensor
    """Nucleus mass (1 when off), float32."""
    greedy: torch.Tensor
    """True where temperature == 0, bool."""
    uniform: torch.Tensor
    """This step's uniform in [0, 1) per row, float32."""
    max_top_k: int
    """Largest top_k of a restricting row, 0 if no row restricts top-k (known on the host)."""
    use_top_p: bool
    """Whether any row restricts top-p."""
    any_greedy: bool
    """Whether any row is greedy."""
    repetition_penalty: torch.Tensor | None = None
    """Penalty per row (1 when off), float32; None when no row has one."""
    seen: torch.Tensor | None = None
    """[B, V] bool: the tokens each row's sequence holds so far (with `repetition_penalty`)."""


def sample(logits: torch.Tensor, params: BatchSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V]; return (token_ids [B] int64, logprobs [B] fp32)."""
    logits = logits.float()
    if params.repetition_penalty is not None:
        assert params.seen is not None, "a repetition penalty needs the tokens seen"
        penalty = params.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(params.seen, penalised, logits)
    scaled = logits * params.inv_temperature[:, None]
    if params.use_top_p:
        return _sample_restricted(scaled, params)
    if params.max_top_k:
        # Top-k alone needs no sort: mask everything below each row's k-th largest logit.
        # Ties with the k-th logit are kept, as in HF's TopKLogitsWarper.
        largest = torch.topk(scaled, params.max_top_k, dim=-1).values
        kth = largest.gather(1, (params.top_k.clamp(max=params.max_top_k) - 1)[:, None])
        kth = kth.masked_fill((params.top_k > params.max_top_k)[:, None], float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    cdf = torch.exp(scaled - lse).cumsum_(dim=-1)
    # Scale by the total so that float rounding in the cumsum can never push u past the end.
    u = (params.uniform[:, None] * cdf[:, -1:]).contiguous()
    tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=scaled.shape[-1] - 1)
    if params.any_greedy:
        tokens = torch.where(params.greedy[:, None], scaled.argmax(dim=-1, keepdim=True), tokens)
    logprobs = scaled.gather(1, tokens) - lse
    return tokens.view(-1), logprobs.view(-1)


def _sample_restricted(
    scaled: torch.Tensor, params: BatchSampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p (and top-k) path: sort descending, where both filters are prefix masks."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)
    drop = rank[None, :] >= params.top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 are left alone: rounding can make mass_before reach 1.0 in the tail.
    drop |= (mass_before >= params.top_p[:, None]) & (params.top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    lse = torch.logsumexp(sorted_logits, dim=-1, keepdim=True)
    cdf = torch.exp(sorted_logits - lse).cumsum_(dim=-1)
    u = (params.uniform[:, None] * cdf[:, -1:]).contiguous()
    num_kept = (~drop).sum(dim=-1, keepdim=True)
    pick = torch.minimum(torch.searchsorted(cdf, u, right=True), num_kept - 1)
    if params.any_greedy:
        pick = pick.masked_fill(params.greedy[:, None], 0)
    logprobs = sorted_logits.gather(1, pick) - lse
    return order.gather(1, pick).view(-1), logprobs.view(-1)
