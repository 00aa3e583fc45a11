"""Loss aggregation over tokens and sequences, with explicit global denominators.

Which average a loss takes changes what it optimises: "token-mean" weights every token equally
(DAPO, Yu et al. 2025, arXiv:2503.14476, Sec. 3.3); "token-sum" adds them up without a
denominator (cosmos-rl's distillation configs); "seq-mean-token-mean" weights every sequence
equally (GRPO, Shao et al. 2024, arXiv:2402.03300); "seq-mean-token-sum-norm", and
"seq-mean-token-mean" when a constant `max_tokens` is given, divide every sequence by one
constant so that length carries no bias (Dr.GRPO, Liu et al. 2025, arXiv:2503.20783). The denominators are passed in, never computed here: a step is split over
micro-batches and data-parallel ranks, and only the caller knows the global counts. With them,
the values returned for every micro-batch of every rank sum to the loss of the whole step.

A sequence is assumed never to be split across micro-batches (its own token count, used by
"seq-mean-token-mean", is local). A denominator of 0 means there is nothing to learn from; it is
read as 1, so that an all-masked batch gives a loss of exactly 0 instead of NaN.
"""

from __future__ import annotations

from torch import Tensor

LOSS_TYPES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""Accepted values of `loss_type`."""


def aggregate(
    values: Tensor,
    mask: Tensor,
    *,
    loss_type: str,
    num_tokens: float,
    num_sequences: float,
    max_tokens: int | None = None,
) -> Tensor:
    """Reduce per-token values [B, T] to this micro-batch's share of the step's loss.

    Args:
        values: per-token values [B, T] (may carry gradient).
        mask: [B, T] float, 1 for tokens that count, 0 for prompt and padding.
        loss_type: one of `LOSS_TYPES`:
            "token-mean": sum over all tokens / num_tokens;
            "token-sum": sum over all tokens (no denominator);
            "seq-mean-token-sum": sum over each sequence's tokens, summed / num_sequences;
            "seq-mean-token-mean": mean over each sequence's tokens, summed / num_sequences;
            with `max_tokens` given, each sequence's sum / max_tokens instead (Dr.GRPO);
            "seq-mean-token-sum-norm": sum over each sequence's tokens / max_tokens,
            summed / num_sequences (Dr.GRPO).
        num_tokens: masked tokens in the whole step (all micro-batches, all ranks).
        num_sequences: sequences in the whole step (all micro-batches, all ranks).
        max_tokens: Dr.GRPO's constant per-sequence divisor: needed by
            "seq-mean-token-sum-norm", optional for "seq-mean-token-mean", unused otherwise.

    Returns:
        A scalar tensor.
    """
    assert values.shape == mask.shape, (values.shape, mask.shape)
    seq_sums = (values * mask).sum(dim=-1)
    # Five fixed formulas that differ by one denominator read better as one function than as a
    # registry of five.
    if loss_type == "token-mean":
        return seq_sums.sum() / max(num_tokens, 1.0)
    if loss_type == "token-sum":
        return seq_sums.sum()
    if loss_type == "seq-mean-token-mean" and max_tokens is not None:
        seq_sums = seq_sums / max_tokens
    elif loss_type == "seq-mean-token-mean":
        # A sequence without tokens has sum 0, so it contributes 0 / 1 = 0.
        seq_sums = seq_sums / mask.sum(dim=-1).clamp(min=1.0)
    elif loss_type == "seq-mean-token-sum-norm":
        if max_tokens is None or max_tokens <= 0:
            raise ValueError(
                "loss_type 'seq-mean-token-sum-norm' needs a max_tokens > 0 (Dr.GRPO's constant), "
                f"got {max_tokens}"
            )
        seq_sums = seq_sums / max_tokens
    elif loss_type != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {list(LOSS_TYPES)}")
    return seq_sums.sum() / max(num_sequences, 1.0)
