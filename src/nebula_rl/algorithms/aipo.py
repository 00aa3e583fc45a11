"""AIPO: truncated importance weights for off-policy (asynchronous) rollouts.

LlamaRL (Wu et al. 2025, "LlamaRL: A Distributed Asynchronous Reinforcement Learning Framework
for Efficient Large-scale LLM Training", arXiv:2505.24034) names it Asynchronous Importance
weighted Policy Optimization: rollouts come from a behaviour policy mu a few versions behind,
and the policy gradient is corrected by the truncated, detached weight min(pi / mu, rho), which
bounds the variance (rho in [2, 10] is typical). Unlike PPO there is no two-sided clip.

Here pi is the proximal policy pi_old (recomputed by the trainer at the start of the step), so
per token loss = -min(pi_old / mu, rho) * (pi_theta / pi_old) * A. With one optimiser step per
batch (pi_theta = pi_old), its gradient is exactly min(pi / mu, rho) * A * grad log pi_theta.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nebula_rl.algorithms.base import LossSettings, PolicyBatch, token_advantages
from nebula_rl.algorithms.regularizers import finish_loss, token_mean_metric


def aipo_weight(old_logprobs: Tensor, behaviour_logprobs: Tensor, *, rho: float) -> Tensor:
    """Detached per-token weight min(pi_old / pi_behaviour, rho), [B, T]."""
    weight = torch.exp(old_logprobs.detach() - behaviour_logprobs.detach())
    return weight.clamp(max=rho)


def aipo_loss(
    batch: PolicyBatch, settings: LossSettings, *, num_tokens: float, num_sequences: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """AIPO policy loss: truncated-importance-weighted policy gradient (then KL, entropy).

    Needs `settings.aipo_rho` and `batch.behaviour_logprobs`. Same arguments as `grpo_loss`;
    metrics: "truncated_frac" (tokens whose weight hit rho), "ratio_mean",
    "behaviour_weight_mean", "pg_loss", and "kl" / "entropy" when given.
    """
    if settings.aipo_rho is None:
        raise ValueError("variant 'aipo' needs train.train_policy.aipo_rho to be set")
    if batch.behaviour_logprobs is None:
        raise ValueError("variant 'aipo' needs behaviour_logprobs from the rollout engine")
    ratio = torch.exp(batch.logprobs - batch.old_logprobs.detach())
    weight = aipo_weight(batch.old_logprobs, batch.behaviour_logprobs, rho=settings.aipo_rho)
    pg_loss = -weight * ratio * token_advantages(batch)
    truncated = (batch.old_logprobs - batch.behaviour_logprobs).exp() > settings.aipo_rho
    metrics = {
        "truncated_frac": token_mean_metric(
            truncated.to(ratio.dtype), batch.mask, num_tokens=num_tokens
        ),
        "ratio_mean": token_mean_metric(ratio, batch.mask, num_tokens=num_tokens),
        "behaviour_weight_mean": token_mean_metric(weight, batch.mask, num_tokens=num_tokens),
    }
    return finish_loss(
        pg_loss,
        batch,
        settings,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        metrics=metrics,
    )
