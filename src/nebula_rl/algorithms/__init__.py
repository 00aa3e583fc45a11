"""RL and SFT algorithms as pure tensor functions, and the `ALGORITHMS` registry.

`ALGORITHMS[variant]` (the `[train.train_policy] variant` key) gives an `Algorithm`: its
advantage function, its loss, its group filter and the paper's default `LossSettings`:

- "grpo": GRPO (Shao et al. 2024), with cosmos-rl's defaults (token-mean aggregation).
- "dapo": GRPO + clip-higher, token-mean, no KL, dynamic sampling (Yu et al. 2025).
- "gspo": sequence-level ratio with tight clip ranges (Zheng et al. 2025).
- "aipo": truncated off-policy importance weights, no clip (LlamaRL, Wu et al. 2025).

Every loss takes explicit global denominators `num_tokens` and `num_sequences`. `policy_loss`
picks the loss a step uses: AIPO's whenever `aipo_rho` is set, as in cosmos-rl.
"""

from __future__ import annotations

from nebula_rl.algorithms.aggregation import LOSS_TYPES, aggregate
from nebula_rl.algorithms.aipo import aipo_loss, aipo_weight
from nebula_rl.algorithms.base import (
    AdvantageFn,
    Algorithm,
    LossFn,
    LossSettings,
    PolicyBatch,
)
from nebula_rl.algorithms.dapo import dynamic_sampling_filter
from nebula_rl.algorithms.distill import (
    discounted_future_sum,
    distillation_advantages,
    sampled_token_divergence,
    top_k_divergence,
)
from nebula_rl.algorithms.grpo import (
    clipped_policy_loss,
    group_advantages,
    grpo_advantages,
    grpo_loss,
    keep_all_groups,
)
from nebula_rl.algorithms.gspo import gspo_loss, gspo_sequence_log_ratio, gspo_token_ratio
from nebula_rl.algorithms.masking import off_policy_sequence_mask, shared_prefix_lengths
from nebula_rl.algorithms.ppo import decoupled_weight, ppo_clip_loss
from nebula_rl.algorithms.regularizers import (
    finish_loss,
    importance_weighted_k3_kl,
    k3_kl,
    positive_nll,
    token_mean_metric,
)
from nebula_rl.algorithms.sft import IGNORE_INDEX, sft_loss, sft_loss_from_logprobs, sft_num_tokens
from nebula_rl.config import VARIANT_DEFAULTS

ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(
        advantages=group_advantages,
        loss=grpo_loss,
        keep_groups=keep_all_groups,
        defaults=LossSettings(**VARIANT_DEFAULTS["grpo"]),
    ),
    "dapo": Algorithm(
        advantages=group_advantages,
        loss=grpo_loss,
        keep_groups=dynamic_sampling_filter,
        defaults=LossSettings(**VARIANT_DEFAULTS["dapo"]),
    ),
    "gspo": Algorithm(
        advantages=group_advantages,
        loss=gspo_loss,
        keep_groups=keep_all_groups,
        defaults=LossSettings(**VARIANT_DEFAULTS["gspo"]),
    ),
    "aipo": Algorithm(
        advantages=group_advantages,
        loss=aipo_loss,
        keep_groups=keep_all_groups,
        defaults=LossSettings(**VARIANT_DEFAULTS["aipo"]),
    ),
}
"""RL variants by their `[train.train_policy] variant` name; each one's `defaults` are the
config layer's `VARIANT_DEFAULTS` (applied there to the keys a config does not set)."""


def get_algorithm(name: str) -> Algorithm:
    """The `ALGORITHMS` entry for `name`; ValueError naming the valid choices otherwise."""
    if name not in ALGORITHMS:
        raise ValueError(
            f"unknown train.train_policy.variant {name!r}; choose one of {sorted(ALGORITHMS)}"
        )
    return ALGORITHMS[name]


def policy_loss(variant: str, settings: LossSettings) -> LossFn:
    """The loss of a step: AIPO's whenever `settings.aipo_rho` is set (cosmos-rl replaces the
    PPO clip by AIPO's truncation for every variant then; the config refuses it for "gspo"),
    else the variant's own."""
    return aipo_loss if settings.aipo_rho is not None else get_algorithm(variant).loss


__all__ = [
    "ALGORITHMS",
    "IGNORE_INDEX",
    "LOSS_TYPES",
    "AdvantageFn",
    "Algorithm",
    "LossFn",
    "LossSettings",
    "PolicyBatch",
    "aggregate",
    "aipo_loss",
    "aipo_weight",
    "clipped_policy_loss",
    "decoupled_weight",
    "discounted_future_sum",
    "distillation_advantages",
    "dynamic_sampling_filter",
    "finish_loss",
    "get_algorithm",
    "group_advantages",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_sequence_log_ratio",
    "gspo_token_ratio",
    "importance_weighted_k3_kl",
    "k3_kl",
    "keep_all_groups",
    "off_policy_sequence_mask",
    "policy_loss",
    "positive_nll",
    "ppo_clip_loss",
    "sampled_token_divergence",
    "sft_loss",
    "sft_loss_from_logprobs",
    "sft_num_tokens",
    "shared_prefix_lengths",
    "token_mean_metric",
    "top_k_divergence",
]
