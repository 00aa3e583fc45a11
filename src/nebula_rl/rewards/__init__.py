"""Rewards: pure functions ``fn(completion, reference) -> float`` of text, looked up by name.

Built in: ``boxed_math`` and ``direct_math`` (math-verify), ``gsm8k``, ``arithmetic``,
``single_choice`` and ``format`` (cosmos-rl's: the Cosmos-Reason recipe's pair), and
``answer_format`` (a boxed or ``####`` final answer). Register your own with ``@register_reward("name")`` or name it in a config as
``"module.path:function"``; ``combine_rewards`` turns a config's ``reward_function`` (a name, a
list of names, or a ``{name: weight}`` mapping) into one picklable callable.
``overlong_penalty`` is DAPO's length penalty; it takes a token count, so it is not registered.
``scorer(cfg)`` builds what the training loops score with from the config's reward keys (a
``RemoteScorer`` that asks the reward service, with ``use_remote_reward``).

math-verify is imported only when a math reward first runs, so importing this package is cheap.
"""

# Importing the reward modules registers their rewards in REWARDS.
from nebula_rl.rewards.arithmetic import arithmetic_reward
from nebula_rl.rewards.base import (
    REWARDS,
    CombinedReward,
    RewardFn,
    combine_rewards,
    get_reward,
    register_reward,
    takes_custom,
)
from nebula_rl.rewards.choice import single_choice_reward
from nebula_rl.rewards.format import answer_format_reward, format_reward
from nebula_rl.rewards.gsm8k import gsm8k_reward
from nebula_rl.rewards.math_answer import boxed_math_reward, direct_math_reward
from nebula_rl.rewards.overlong import overlong_penalty
from nebula_rl.rewards.scoring import (
    RemoteScorer,
    Scored,
    Scorer,
    filter_values,
    remote_settings,
    scorer,
)

__all__ = [
    "REWARDS",
    "CombinedReward",
    "RemoteScorer",
    "RewardFn",
    "Scored",
    "Scorer",
    "answer_format_reward",
    "arithmetic_reward",
    "boxed_math_reward",
    "combine_rewards",
    "direct_math_reward",
    "filter_values",
    "format_reward",
    "get_reward",
    "gsm8k_reward",
    "overlong_penalty",
    "register_reward",
    "remote_settings",
    "scorer",
    "single_choice_reward",
    "takes_custom",
]
