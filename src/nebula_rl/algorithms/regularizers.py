"""The loss tail every RL variant ends with: masking, aggregation, KL penalty, entropy bonus;
and VAPO's positive-example LM loss.

`finish_loss` drops off-policy negative sequences when asked (DeepSeek-V3.2, `masking.py`),
aggregates a per-token policy loss with explicit denominators (`aggregation.py`), adds kl_beta
times the k3 KL estimate to a frozen reference policy (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html), optionally importance-weighted by
pi_theta / pi_old so that it stays unbiased for samples of pi_old (DeepSeek-AI 2025,
"DeepSeek-V3.2", Sec. 3.1, "Unbiased KL Estimate"), and subtracts entropy_coef times the
entropy, which carries gradient so that the bonus acts on the policy.

`positive_nll` is VAPO's positive-example LM loss (Yue et al. 2025, "VAPO: Efficient and
Reliable Reinforcement Learning for Advanced Reasoning Tasks", arXiv:2504.05118, Sec. 4.3): the
negative log-likelihood of the completions that earned a positive reward, a token mean with its
own denominator (their token count), so it is added by the caller, not by `finish_loss`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nebula_rl.algorithms.aggregation import aggregate
from nebula_rl.algorithms.base import LossSettings, PolicyBatch, sequence_advantages
from nebula_rl.algorithms.masking import off_policy_sequence_mask


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = ref - logp.

    Unbiased under samples from pi_theta and always >= 0 (Schulman 2020, see module docstring).
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def importance_weighted_k3_kl(
    logprobs: Tensor, ref_logprobs: Tensor, old_logprobs: Tensor
) -> Tensor:
    """Per-token (pi_theta / pi_old) * k3(pi_theta, pi_ref): the k3 estimate made unbiased for
    tokens sampled by pi_old (DeepSeek-V3.2). As in cosmos-rl the weight carries gradient
    through pi_theta; pi_old is detached."""
    return torch.exp(logprobs - old_logprobs.detach()) * k3_kl(logprobs, ref_logprobs)


def positive_nll(logprobs: Tensor, mask: Tensor, positive: Tensor, *, num_tokens: float) -> Tensor:
    """VAPO's positive-example LM loss: -sum of log pi_theta over the masked tokens of the
    sequences with `positive` set, / num_tokens.

    Args:
        logprobs: [B, T] log pi_theta of the sampled tokens (carries grad).
        mask: [B, T] float, 1 on the tokens that carry loss.
        positive: [B] bool, True for sequences whose reward is > 0.
        num_tokens: masked tokens of positive sequences in the whole step (all micro-batches,
            ranks and replicas); 0 is read as 1.
    """
    weights = mask * positive.unsqueeze(-1).to(mask.dtype)
    return -(logprobs * weights).sum() / max(num_tokens, 1.0)


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
    """Mask off-policy sequences, aggregate a per-token policy loss, add kl_beta * KL, subtract
    entropy_coef * entropy.

    Returns the scalar loss and `metrics` extended with "pg_loss", "kl" and "entropy" (each
    aggregated with `settings.loss_type`; "kl" and "entropy" only when their inputs are given),
    and "off_policy_masked_frac" (this micro-batch's share of the sequences masked) when
    `settings.off_policy_masking_delta` is set.
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

    if settings.off_policy_masking_delta is not None:
        # cosmos-rl compares with the rollout's log-probs when the batch carries them.
        source = (
            batch.behaviour_logprobs if batch.behaviour_logprobs is not None else batch.old_logprobs
        )
        keep = off_policy_sequence_mask(
            batch.logprobs,
            source,
            sequence_advantages(batch),
            batch.mask,
            delta=settings.off_policy_masking_delta,
        )
        pg_loss = pg_loss * keep.unsqueeze(-1)
        metrics["off_policy_masked_frac"] = (1.0 - keep).sum() / max(num_sequences, 1.0)
    loss = reduce(pg_loss)
    metrics["pg_loss"] = loss.detach()
    if settings.kl_beta != 0.0 and batch.ref_logprobs is None:
        raise ValueError("train.train_policy.kl_beta != 0 needs ref_logprobs in the batch")
    if batch.ref_logprobs is not None:
        per_token_kl = (
            importance_weighted_k3_kl(batch.logprobs, batch.ref_logprobs, batch.old_logprobs)
            if settings.unbiased_kl_estimate
            else k3_kl(batch.logprobs, batch.ref_logprobs)
        )
        kl = reduce(per_token_kl)
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
