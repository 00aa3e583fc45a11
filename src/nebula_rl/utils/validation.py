"""RL validation: when it runs and what it reports (cosmos-rl's semantics; torch-free, since the
controller aggregates it).

With `validation.enable`, the weights of step `s` are validated when `s == 0` and
`validation.val_before_train` (the initial weights), when `s` is a multiple of `validation.freq`,
and after the last step (`s == total_steps`). A validation generates `validation.n_generation`
completions for each validation row (`nebula_rl.data.rl_validation_rows`) with the validation
sampling settings, scores them with the validation rewards (`nebula_rl.rewards.scorer(cfg,
validation=True)`), and reports :func:`validation_metrics` in the metrics record of step `s`.
Nothing of it is trained; there is no dynamic sampling and no prefix filtering.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from nebula_rl.config import Config, ValidationConfig

__all__ = ["VALIDATION_KEYS", "validation_due", "validation_metrics", "validation_seed"]

VALIDATION_KEYS = (
    "val/reward_mean",
    "val/reward_std",
    "val/reward_max",
    "val/reward_min",
    "val/rollout_count",
    "val/response_length_mean",
    "val/policy_version",
)
"""The metrics a language model's validation adds to its step's record (a world model's:
`nebula_rl.flow.validation.FLOW_VALIDATION_KEYS`)."""


def validation_due(v: ValidationConfig, step: int, *, total_steps: int) -> bool:
    """Whether `[validation]` validates the weights after step `step` (0: the initial ones)."""
    if not v.enable:
        return False
    if step == 0:
        return v.val_before_train
    return step % v.freq == 0 or step == total_steps


def validation_metrics(
    rewards: Sequence[float],
    lengths: Sequence[int] | None,
    versions: Sequence[int],
    *,
    distances: Sequence[float] = (),
) -> dict[str, float]:
    """The `val/*` metrics of a validation's completions: their rewards (mean, population std,
    max, min), how many there were, their mean length in tokens (a language model's; None for a
    world model's samples), and the oldest policy version that generated them (the validated
    step's, as a check); with `distances` (a world model's, one per sample), their mean as
    `val/data_distance`. Only the count when there were no rewards (every prompt failed to
    generate, or its rewards were lost)."""
    out: dict[str, float] = {}
    if distances:
        out["val/data_distance"] = sum(distances) / len(distances)
    if not rewards:
        return {**out, "val/rollout_count": 0}
    count = len(rewards)
    mean = sum(rewards) / count
    out |= {
        "val/reward_mean": mean,
        "val/reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / count),
        "val/reward_max": max(rewards),
        "val/reward_min": min(rewards),
        "val/rollout_count": count,
    }
    if lengths is not None:
        out["val/response_length_mean"] = sum(lengths) / count
    return {**out, "val/policy_version": min(versions)}


def validation_seed(cfg: Config, step: int, index: int) -> int:
    """The sampling seed of validation row `index` at step `step`: its samples do not depend on
    which replica draws them, or on the training samples drawn before."""
    base = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.train.seed or 0
    return ((base * 1_000_003 + step) * 1_000_003 + index * cfg.validation.n_generation) % (1 << 62)
