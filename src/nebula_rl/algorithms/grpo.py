"""GRPO: group-normalised advantages and the clipped policy loss.

Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), Sec. 4.1: each prompt is sampled
`group_size` times and a completion's advantage is its reward standardised within its group,
(r - mean) / (std + eps), which replaces the critic. Dr.GRPO (Liu et al. 2025, "Understanding
R1-Zero-Like Training", arXiv:2503.20783) drops the division by std, which over-weights groups
whose rewards barely differ; set `normalize_std=False` for it.

The loss is per-token PPO-clip against the proximal policy, with dual clip, and the decoupled
behaviour weight when the rollout engine's log-probs are given (see `ppo.py`).
Simplification: one advantage per sequence (outcome rewards), broadcast over its tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nebula_rl.algorithms.base import LossSettings, PolicyBatch, token_advantages
from nebula_rl.algorithms.ppo import decoupled_weight, ppo_clip_loss
from nebula_rl.algorithms.regularizers import finish_loss, token_mean_metric

ADVANTAGE_EPS = 1e-6
"""Added to the group std so that near-constant groups do not blow up."""


def grpo_advantages(rewards: Tensor, *, normalize_std: bool = True) -> Tensor:
    """Advantages (r - group mean) / (group std + eps), or r - group mean without std.

    The std is the unbiased (n - 1) sample std, as in the reference implementations. A group
    whose rewards are all equal gets advantages of exactly 0 (never NaN).

    Args:
        rewards: [num_groups, group_size], group_size >= 2.
        normalize_std: divide by the group std (GRPO); False centres only (Dr.GRPO).

    Returns:
        [num_groups, group_size] advantages, same dtype as `rewards`.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must be [num_groups, group_size] with group_size >= 2, got {tuple(rewards.shape)}"
        )
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (rewards.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    # The mean of equal floats can be off by one ulp; equal groups must carry no signal at all.
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centred), centred)


def group_advantages(rewards: Tensor, settings: LossSettings) -> Tensor:
    """`grpo_advantages` with the std switch read from `settings` (the registry signature),
    clipped to [settings.advantage_low, settings.advantage_high]."""
    advantages = grpo_advantages(rewards, normalize_std=settings.normalize_std)
    return advantages.clamp(settings.advantage_low, settings.advantage_high)


def keep_all_groups(rewards: Tensor) -> Tensor:
    """Keep every group: bool [num_groups] of True (no dynamic sampling)."""
    return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)


def grpo_loss(
    batch: PolicyBatch, settings: LossSettings, *, num_tokens: float, num_sequences: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO policy loss: token-level PPO-clip (+ dual clip, decoupled weight, KL, entropy).

    Args:
        batch: the micro-batch.
        settings: clip ranges, loss_type, coefficients.
        num_tokens: masked tokens in the whole step (all micro-batches and ranks).
        num_sequences: sequences in the whole step (all micro-batches and ranks).

    Returns:
        (scalar loss, detached metrics: "clip_frac", "ratio_mean", "pg_loss", and "kl",
        "entropy", "behaviour_weight_mean" when their inputs are present). Token-mean metrics are
        this micro-batch's share, so they sum to the step's value.
    """
    ratio = torch.exp(batch.logprobs - batch.old_logprobs.detach())
    return clipped_policy_loss(
        ratio, batch, settings, num_tokens=num_tokens, num_sequences=num_sequences
    )


def clipped_policy_loss(
    ratio: Tensor,
    batch: PolicyBatch,
    settings: LossSettings,
    *,
    num_tokens: float,
    num_sequences: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip on a given per-token `ratio` [B, T], then decoupled weight, KL and entropy.

    Shared by GRPO/DAPO (token ratio) and GSPO (sequence ratio); see `grpo_loss` for the rest.
    """
    pg_loss, is_clipped = ppo_clip_loss(
        ratio,
        token_advantages(batch),
        epsilon_low=settings.epsilon_low,
        epsilon_high=settings.epsilon_high,
        lower_bound_ratio=settings.lower_bound_ratio,
    )
    metrics = {
        "clip_frac": token_mean_metric(
            is_clipped.to(ratio.dtype), batch.mask, num_tokens=num_tokens
        ),
        "ratio_mean": token_mean_metric(ratio, batch.mask, num_tokens=num_tokens),
    }
    if batch.behaviour_logprobs is not None:
        weight = decoupled_weight(
            batch.old_logprobs, batch.behaviour_logprobs, cap=settings.behaviour_weight_cap
        )
        pg_loss = pg_loss * weight
        metrics["behaviour_weight_mean"] = token_mean_metric(
            weight, batch.mask, num_tokens=num_tokens
        )
    return finish_loss(
        pg_loss,
        batch,
        settings,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        metrics=metrics,
    )
