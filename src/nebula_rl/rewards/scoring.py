"""How a job scores its completions: the config's reward keys turned into one picklable scorer.

`scorer(cfg)` reads `train.train_policy.reward_function` (the weighted total), `bypass_reward`
(every reward 0, no function runs), `filter_reward_metric` (functions whose own values dynamic
sampling filters on), `overlong_reward` (DAPO's length penalty, added to the total) and the
free-form `custom` table (passed to user functions that take it), and
`group_reward_calculation` (user functions called once per group); `scorer(cfg, validation=True)`
scores validation generations with `validation.reward_function` (else the training functions),
without the overlong penalty, which shapes training only. The scorer is sent to the reward
processes as it is, so both loops score the same way.

With `use_remote_reward` (validation: `validation.use_remote_reward`, else as training) the
scorer is a :class:`RemoteScorer` instead: it sends each group's completions, with the prompt's
reference answer, to the reward service from a thread of its own, so generation goes on while
scores are pending (`submit` returns a future). Each reward of `remote_reward.reward_fns` is
clipped to [clip_min, clip_max] and weighted; the sum is scaled and clipped to
[reward_clip_min, reward_clip_max] (as for world models); the overlong penalty is added after.
A group whose scores do not come back (the service is down, gave up, or answered an error) is
scored again after a pause, with a warning each time: its completions are kept and its prompt
stays claimed and unacknowledged until then, so nothing is lost (if the replica dies meanwhile,
the controller hands the prompt to another).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nebula_rl.config import Config, RemoteRewardConfig
from nebula_rl.protocol import Completion
from nebula_rl.rewards.base import CombinedReward, combine_rewards
from nebula_rl.rewards.overlong import overlong_penalty

if TYPE_CHECKING:
    from nebula_rl.rewards.remote import RemoteRewardClient

__all__ = [
    "Overlong",
    "RemoteScorer",
    "Scored",
    "Scorer",
    "filter_values",
    "remote_settings",
    "scorer",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Overlong:
    """DAPO's soft overlong penalty settings (see :func:`overlong_penalty`)."""

    max_response_length: int
    buffer_length: int
    penalty_factor: float

    def penalty(self, num_tokens: int) -> float:
        """The penalty of a completion of `num_tokens` tokens (0 or negative)."""
        return overlong_penalty(
            num_tokens,
            max_response_length=self.max_response_length,
            buffer_length=self.buffer_length,
            penalty_factor=self.penalty_factor,
        )


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
        """Score one completion of `num_tokens` tokens whose text is `text` (a group of one)."""
        return self.score_group([text], [num_tokens], reference)[0]

    def score_group(
        self, texts: Sequence[str], lengths: Sequence[int], reference: str
    ) -> list[Scored]:
        """Scores of one group's completions (run in a reward process, or inline); each user
        function is called once for the group with `group_reward_calculation`."""
        if self.reward is None:
            return [Scored(0.0, {}) for _ in texts]
        terms = self.reward.group_values(texts, reference)
        if self.filter_only is not None:
            extra = self.filter_only.group_values(texts, reference)
        out = []
        for i, num_tokens in enumerate(lengths):
            total = sum(weight * terms[i][name] for name, _, weight in self.reward.terms)
            if self.filter_only is not None:
                terms[i] |= extra[i]
            if self.overlong is not None:
                total += self.overlong.penalty(num_tokens)
            out.append(Scored(total, terms[i]))
        return out


class RemoteScorer:
    """Scores groups with a reward service, in threads (see the module docstring); not
    picklable: it runs in the replica's process. `close()` when done."""

    def __init__(
        self,
        settings: RemoteRewardConfig,
        client: RemoteRewardClient,
        *,
        overlong: Overlong | None = None,
        max_groups: int = 8,
        retry_s: float = 5.0,
    ) -> None:
        self.settings, self.client, self.overlong = settings, client, overlong
        self.retry_s = retry_s
        """Pause before a group whose scores did not come back is sent again."""
        self.weights = {f.name: f for f in settings.reward_fns}
        self.score_keys = {f.name: f.score_key or f.name for f in settings.reward_fns}
        """Where each reward's score is in the service's answer (`a+b`: summed)."""
        self._pool = ThreadPoolExecutor(max(1, max_groups), thread_name_prefix="nebula-reward")
        self._closed = threading.Event()

    def submit(
        self, texts: Sequence[str], lengths: Sequence[int], reference: str, *, group: str = ""
    ) -> Future[list[Scored]]:
        """Score one group (`group` names it in log lines) in a thread; the future's result is
        its scores (see :meth:`score_group`)."""
        return self._pool.submit(self.score_group, texts, lengths, reference, group=group)

    def score_group(
        self, texts: Sequence[str], lengths: Sequence[int], reference: str, *, group: str = ""
    ) -> list[Scored]:
        """The scores of one group's completions; blocks until the service has answered,
        sending the group again after `retry_s` as long as it does not (raises `RuntimeError`
        once closed). A refused token or a request the service refuses (an unknown reward)
        raises: those are configuration errors."""
        from nebula_rl.rewards.remote import RemoteRewardError

        attempt = 0
        while True:
            attempt += 1
            try:
                values = self._try(texts, reference)
            except RemoteRewardError as err:
                values, reason = None, str(err)
            else:
                reason = "it gave up, failed or did not answer in time"
            if values is not None:
                break
            if self._closed.is_set():
                raise RuntimeError(f"remote rewards of group {group}: the scorer was closed")
            log.warning(
                "remote rewards of group %s not scored (attempt %d: %s); sending it again in "
                "%.0f s (its completions are kept, its prompt stays unacknowledged)",
                group,
                attempt,
                reason,
                self.retry_s,
            )
            self._closed.wait(self.retry_s)
        return [self._scored(terms, n) for terms, n in zip(values, lengths, strict=True)]

    def _try(self, texts: Sequence[str], reference: str) -> list[dict[str, float]] | None:
        """Each completion's score per reward function, or None when the service did not
        give them."""
        r = self.settings
        asked = dict.fromkeys(self.weights, 1.0)
        uuids = []
        for start in range(0, len(texts), r.batch_size):
            part = list(texts[start : start + r.batch_size])
            prompts = [""] * len(part)  # (text rewards read the completion and the reference)
            uuids.append(self.client.enqueue_text(prompts, part, [reference] * len(part), asked))
        out: list[dict[str, float]] = []
        for uuid in uuids:
            scores = self.client.pull(uuid, list(self.weights), score_keys=self.score_keys)
            if scores is None:
                return None
            count = len(next(iter(scores.values())))
            out += [{name: scores[name][i] for name in self.weights} for i in range(count)]
        return out if len(out) == len(texts) else None

    def _scored(self, terms: dict[str, float], num_tokens: int) -> Scored:
        r = self.settings
        value = sum(
            f.weight * min(max(terms[name], f.clip_min), f.clip_max)
            for name, f in self.weights.items()
        )
        total = min(max(r.scale * value, r.reward_clip_min), r.reward_clip_max)
        if self.overlong is not None:
            total += self.overlong.penalty(num_tokens)
        return Scored(total, terms)

    def close(self) -> None:
        """Stop sending: groups still waiting fail; the HTTP connections close."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def remote_settings(cfg: Config, *, validation: bool = False) -> RemoteRewardConfig | None:
    """The reward service settings training (or `validation`) scores with; None: the rule
    functions in this process. Validation inherits training's `use_remote_reward` and
    `remote_reward` where its own are unset (cosmos-rl's rule)."""
    p, v = cfg.grpo, cfg.validation
    if not p.use_remote_reward or (validation and v.use_remote_reward is False):
        return None
    return (v.remote_reward or p.remote_reward) if validation else p.remote_reward


def scorer(cfg: Config, *, validation: bool = False, max_groups: int = 8) -> Scorer | RemoteScorer:
    """The training scorer of `cfg`, or (`validation`) the validation one; a
    :class:`RemoteScorer` (taking `max_groups` groups at once) with remote rewards."""
    p = cfg.grpo
    grouped = p.group_reward_calculation
    remote = remote_settings(cfg, validation=validation)
    if remote is not None:
        from nebula_rl.rewards.remote import RemoteRewardClient

        o = p.overlong_reward
        overlong = (
            Overlong(cfg.rollout.max_response_length, o.buffer_length, o.penalty_factor)
            if o.enable_overlong_penalty and not validation
            else None
        )
        return RemoteScorer(
            remote, RemoteRewardClient.from_env(), overlong=overlong, max_groups=max_groups
        )
    if validation:
        spec = cfg.validation.reward_function or p.reward_function
        return Scorer(combine_rewards(spec, custom=cfg.custom, grouped=grouped))
    if p.bypass_reward:
        return Scorer(None)
    reward = combine_rewards(p.reward_function, custom=cfg.custom, grouped=grouped)
    extra = [m for m in p.filter_reward_metric if m not in reward.names]
    filter_only = combine_rewards(extra, custom=cfg.custom, grouped=grouped) if extra else None
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
