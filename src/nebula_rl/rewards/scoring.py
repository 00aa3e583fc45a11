"""How a job scores its completions: the config's reward keys turned into one picklable scorer.

`scorer(cfg)` reads `train.train_policy.reward_function` (the weighted total), `bypass_reward`
(every reward 0, no function runs), `filter_reward_metric` (functions whose own values dynamic
sampling filters on), `overlong_reward` (DAPO's length penalty, added to the total) and the
free-form `custom` table (passed to user functions that take it); `scorer(cfg, validation=True)`
scores validation generations with `validation.reward_function` (else the training functions),
without the overlong penalty, which shapes training only. The scorer is sent to the reward
processes as it is, so both loops score the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nebula_rl.config import Config
from nebula_rl.protocol import Completion
from nebula_rl.rewards.base import CombinedReward, combine_rewards
from nebula_rl.rewards.overlong import overlong_penalty

__all__ = ["Overlong", "Scored", "Scorer", "filter_values", "scorer"]


@dataclass(frozen=True, slots=True)
class Overlong:
    """DAPO's soft overlong penalty settings (see :func:`overlong_penalty`)."""

    max_response_length: int
    buffer_length: int
    penalty_factor: float


@dataclass(frozen=True, slots=True)
class Scored:
    """One completion's scores."""

    reward: float
    """The total: the weighted sum of the reward functions (plus the overlong penalty)."""
    terms: dict[str, float]
    """Each reward function's own (unweighted) value by name: those of `reward_function` and of
    `filter_reward_metric`; empty with `bypass_reward`."""


@dataclass(frozen=True, slots=True)
class Scorer:
    """Scores completions; picklable (sent to reward processes)."""

    reward: CombinedReward | None
    """The weighted total; None: every reward is 0 (`bypass_reward`)."""
    filter_only: CombinedReward | None = None
    """`filter_reward_metric` functions that are not in the total (their values are only
    recorded, for dynamic sampling)."""
    overlong: Overlong | None = None
    """The length penalty added to the total, if enabled."""

    def score(self, text: str, num_tokens: int, reference: str) -> Scored:
        """Score one completion of `num_tokens` tokens whose text is `text`."""
        if self.reward is None:
            return Scored(0.0, {})
        terms = self.reward.values(text, reference)
        total = sum(weight * terms[name] for name, _, weight in self.reward.terms)
        if self.filter_only is not None:
            terms |= self.filter_only.values(text, reference)
        if self.overlong is not None:
            total += overlong_penalty(
                num_tokens,
                max_response_length=self.overlong.max_response_length,
                buffer_length=self.overlong.buffer_length,
                penalty_factor=self.overlong.penalty_factor,
            )
        return Scored(total, terms)

    def score_group(
        self, texts: Sequence[str], lengths: Sequence[int], reference: str
    ) -> list[Scored]:
        """Scores of one group's completions (run in a reward process, or inline)."""
        return [self.score(t, n, reference) for t, n in zip(texts, lengths, strict=True)]


def scorer(cfg: Config, *, validation: bool = False) -> Scorer:
    """The training scorer of `cfg`, or (`validation`) the validation one."""
    p = cfg.grpo
    if validation:
        spec = cfg.validation.reward_function or p.reward_function
        return Scorer(combine_rewards(spec, custom=cfg.custom))
    if p.bypass_reward:
        return Scorer(None)
    reward = combine_rewards(p.reward_function, custom=cfg.custom)
    extra = [m for m in p.filter_reward_metric if m not in reward.names]
    filter_only = combine_rewards(extra, custom=cfg.custom) if extra else None
    o = p.overlong_reward
    overlong = (
        Overlong(cfg.rollout.max_response_length, o.buffer_length, o.penalty_factor)
        if o.enable_overlong_penalty
        else None
    )
    return Scorer(reward, filter_only, overlong)


def filter_values(completions: Sequence[Completion], metrics: Sequence[str]) -> list[float]:
    """What dynamic sampling compares within a group: each completion's sum of the `metrics`
    functions' own values (weight 1 each; `filter_reward_metric`), or its total reward when
    `metrics` is empty."""
    if not metrics:
        return [c.reward for c in completions]
    return [sum(c.reward_terms[m] for m in metrics) for c in completions]
