"""DAPO: dynamic sampling, as a filter on groups.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv:2503.14476). DAPO is GRPO's advantages and loss with four changes; three are settings
(clip-higher epsilon_high = 0.28, "token-mean" aggregation, no KL) and live in the registry's
defaults. The fourth, dynamic sampling (Sec. 3.2), is here: a group whose rewards are all equal
has zero advantage everywhere and no gradient, so it is dropped and the controller samples more
prompts until the batch is full. Overlong reward shaping belongs to the reward functions.
"""

from __future__ import annotations

from torch import Tensor


def dynamic_sampling_filter(rewards: Tensor) -> Tensor:
    """bool [num_groups]: True for groups whose rewards are not all equal.

    Args:
        rewards: [num_groups, group_size].
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1)
