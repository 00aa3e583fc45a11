"""The RL loss's settings as the config gives them (`[train.train_policy]`), and the refusal of
those a context-parallel policy cannot compute."""

from __future__ import annotations

from nebula_rl.algorithms import LossSettings
from nebula_rl.config import Config, GrpoConfig


def loss_settings(cfg: Config) -> LossSettings:
    """The algorithm knobs from `[train.train_policy]` (the config is authoritative)."""
    p = cfg.grpo
    max_tokens = p.unbiased_loss_max_tokens
    if max_tokens is None and p.loss_type == "seq-mean-token-sum-norm":
        max_tokens = cfg.rollout.max_response_length
    return LossSettings(
        epsilon_low=p.epsilon_low,
        epsilon_high=p.epsilon_high,
        lower_bound_ratio=p.lower_bound_ratio,
        loss_type=p.loss_type,
        kl_beta=p.kl_beta,
        unbiased_kl_estimate=p.unbiased_kl_estimate,
        entropy_coef=p.entropy_coeff,
        aipo_rho=p.aipo_rho,
        behaviour_weight_cap=p.behav_imp_weight_cap,
        max_tokens=max_tokens,
        normalize_std=not p.unbiased_advantage,
        advantage_low=p.advantage_low,
        advantage_high=p.advantage_high,
        off_policy_masking_delta=p.off_policy_masking_delta,
    )


def _check_context_parallel_loss(settings: LossSettings, p: GrpoConfig) -> None:
    """Under CP a sequence's tokens are spread over ranks: losses that reduce over a whole
    sequence first are refused, naming their keys."""
    per_sequence = []
    if p.variant == "gspo":
        per_sequence.append("variant = 'gspo' (a sequence-level ratio)")
    if settings.loss_type == "seq-mean-token-mean" and settings.max_tokens is None:
        per_sequence.append("loss_type = 'seq-mean-token-mean' (a per-sequence token mean)")
    if settings.off_policy_masking_delta is not None:
        per_sequence.append("off_policy_masking_delta (a per-sequence mean)")
    if per_sequence:
        raise ValueError(
            "policy.parallelism.cp_size > 1 spreads each sequence over ranks; "
            f"train.train_policy.{', '.join(per_sequence)} needs whole sequences"
        )
