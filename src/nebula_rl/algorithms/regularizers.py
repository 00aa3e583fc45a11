"""The loss tail every RL variant ends with: aggregation, KL penalty, entropy bonus.

`finish_loss` aggregates a per-token policy loss with explicit denominators (`aggregation.py`),
adds kl_beta times the k3 KL estimate to a frozen reference policy (Schulman 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html) and subtracts
entropy_coef times the entropy, which carries gradient so that the bonus acts on the policy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nebula_rl.algorithms.aggregation import aggregate
from nebula_rl.algorithms.base import LossSettings, PolicyBatch


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = ref - logp.

    Unbiased under samples from pi_theta and always >= 0 (Schulman 2020, see module docstring).
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def token_mean_metric(values: Tensor, mask: Tensor, *, num_tokens: float) -> Tensor:
    """Detached share of the global token mean of `values`: sums to it over micro-batches."""
    return (values.detach() * mask).sum() / max(num_tokens, 1.0)


def finish_loss(
    pg_loss: Tensor,
    batch: PolicyBatch,
    settings: LossSettings,
    *,
    num_tokens: float,
    num_sequences: float,
    metrics: dict[str, Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregate a per-token policy loss, add kl_beta * KL, subtract entropy_coef * entropy.

    Returns the scalar loss and `metrics` extended with "pg_loss", "kl" and "entropy" (each
    aggregated with `settings.loss_type`; "kl" and "entropy" only when their inputs are given).
    """

    def reduce(values: Tensor) -> Tensor:
        return aggregate(
            values,
            batch.mask,
            loss_type=settings.loss_type,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            max_tokens=settings.max_tokens,
        )

    loss = reduce(pg_loss)
    metrics["pg_loss"] = loss.detach()
    if settings.kl_beta != 0.0 and batch.ref_logprobs is None:
        raise ValueError("train.train_policy.kl_beta != 0 needs ref_logprobs in the batch")
    if batch.ref_logprobs is not None:
        kl = reduce(k3_kl(batch.logprobs, batch.ref_logprobs))
        metrics["kl"] = kl.detach()
        if settings.kl_beta != 0.0:
            loss = loss + settings.kl_beta * kl
    if settings.entropy_coef != 0.0 and batch.entropy is None:
        raise ValueError("train.train_policy.entropy_coef != 0 needs entropy in the batch")
    if batch.entropy is not None:
        entropy = reduce(batch.entropy)
        metrics["entropy"] = entropy.detach()
        if settings.entropy_coef != 0.0:
            loss = loss - settings.entropy_coef * entropy
    return loss, metrics
