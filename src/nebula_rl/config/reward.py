"""Reward settings of `[train.train_policy]`: rule reward functions, the overlong penalty and the
remote reward service.
"""

from __future__ import annotations

from pydantic import (
    Field,
)

from nebula_rl.config.base import Section


class OverlongRewardConfig(Section):
    """DAPO's soft overlong punishment (Yu et al., 2025)."""

    enable_overlong_penalty: bool = False
    """Penalise responses whose length enters the last `buffer_length` tokens before the maximum."""
    buffer_length: int = Field(default=4096, ge=1)
    """Length in tokens of the window, ending at `rollout.max_response_length`, over which the
    penalty grows linearly from 0 to `penalty_factor`."""
    penalty_factor: float = Field(default=1.0, ge=0.0)
    """Largest penalty (subtracted from the reward) at and beyond the maximum length."""


class RewardFunctionConfig(Section):
    """One reward of a remote reward service (cosmos-rl's `remote_reward.reward_fns` entry)."""

    name: str = "dance_grpo"
    """Reward function name on the service."""
    weight: float = 1.0
    """Weight in the total reward."""
    score_key: str | None = None
    """Key of the score in the service's answer (`a+b` sums keys); defaults to `name`."""
    clip_min: float = -5.0
    """Lower clip of this reward."""
    clip_max: float = 5.0
    """Upper clip of this reward."""


def _default_reward_fns() -> list[RewardFunctionConfig]:
    return [RewardFunctionConfig(name="dance_grpo", weight=1.0, score_key="overall_reward")]


class RemoteRewardConfig(Section):
    """Rewards computed by a separate reward service (cosmos-rl's `remote_reward`)."""

    scale: float = 1.0
    """Scale of the total reward."""
    reward_fns: list[RewardFunctionConfig] = Field(default_factory=_default_reward_fns)
    """The service's reward functions."""
    reward_clip_min: float = -5.0
    """Lower clip of the total reward."""
    reward_clip_max: float = 5.0
    """Upper clip of the total reward."""
    batch_size: int = Field(default=1, ge=1)
    """Completions per request to the service (a language model's: at most, within one
    prompt's group)."""
