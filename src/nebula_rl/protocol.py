"""Wire types: what travels between the controller, rollout replicas and policy replicas.

Frozen, slotted dataclasses that serialise to JSON (:func:`to_json` / :func:`from_json`) so they
can sit in Redis streams. Token sequences are lists of ints; nothing here holds a tensor.

A pushed group travels as two JSON strings: the whole :class:`RolloutGroup`, which the controller
keeps as it came and only the policy decodes, and its :class:`GroupHeader`, the few fields the
controller judges it by (a header is ~1% of a group of 8 x 128 tokens).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "Completion",
    "FinishReason",
    "GroupHeader",
    "Prompt",
    "RolloutGroup",
    "from_json",
    "to_json",
]

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One dataset row handed out for generation (or for validation)."""

    prompt_id: str
    """Unique within the job: `"<epoch>:<index>"`; `"val<step>:<index>"` for validation."""
    epoch: int
    """Epoch this hand-out belongs to (0-based; 0 for validation)."""
    index: int
    """Row index in the training dataset (in the validation rows for validation)."""
    prompt: str | list[dict[str, Any]] | None
    """Prompt text, or chat messages (whose content may list text, images and videos); None when replicas read the row from their own copy of
    the dataset (`train.local_dataset`)."""
    reference: str | None
    """Reference answer the reward functions compare against; None as `prompt`."""
    min_version: int = 0
    """Generate only with weights of at least this policy version (the controller's staleness
    bound, set when the prompt is handed out; the validated step for validation)."""
    validation_step: int | None = None
    """Set on validation prompts: the training step whose weights this prompt evaluates. They
    are never trained and never count in the training ledger."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled response with what training needs of it."""

    token_ids: list[int]
    """Response tokens, [T]; includes the end-of-sequence token when one was sampled."""
    logprobs: list[float]
    """Log-prob of each token under the sampling distribution used (behaviour policy), [T];
    empty when rollouts do not send them (`train_policy.collect_rollout_logprobs = false`)."""
    text: str
    """Decoded response."""
    finish_reason: FinishReason
    """`stop` (EOS or stop string), `length` (hit max tokens), `abort`."""
    version_changes: list[tuple[int, int]]
    """(token index, policy_version) from which each version generated the tokens; the first
    entry is (0, version at the first token)."""
    reward: float = 0.0
    """Scalar reward, filled in after scoring."""
    reward_terms: dict[str, float] = field(default_factory=dict)
    """Each reward function's own (unweighted) value by name (those of `reward_function` and
    `filter_reward_metric`; dynamic sampling filters on the latter)."""
    teacher_logprobs: list[float] = field(default_factory=list)
    """On-policy distillation: the teacher's log-prob of each token, [T]; empty until a teacher
    scored the completion."""
    teacher_top_k_ids: list[list[int]] = field(default_factory=list)
    """With `distillation.top_k` = k > 0: the teacher's k most likely tokens at each position,
    [T][k]."""
    teacher_top_k_logprobs: list[list[float]] = field(default_factory=list)
    """The teacher's log-probs of `teacher_top_k_ids`, [T][k]."""
    loss_mask: list[int] = field(default_factory=list)
    """Multi-turn: 1 on the tokens the model sampled, 0 on the observations the environment
    appended (tool results), [T]; empty: every token was sampled."""

    @property
    def policy_version(self) -> int:
        """The oldest policy version that produced a token of this completion."""
        return self.version_changes[0][1] if self.version_changes else 0


@dataclass(frozen=True, slots=True)
class RolloutGroup:
    """The `n_generation` completions of one prompt: the unit GRPO normalises over."""

    prompt: Prompt
    """The prompt."""
    prompt_token_ids: list[int]
    """Tokenised prompt as the engine saw it (chat template applied)."""
    completions: list[Completion]
    """`n_generation` completions."""
    replica: str = ""
    """Name of the rollout replica that produced the group."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form metadata (e.g. reward components)."""

    @property
    def rewards(self) -> list[float]:
        """Reward of each completion."""
        return [c.reward for c in self.completions]

    @property
    def policy_version(self) -> int:
        """The oldest policy version among the group's tokens."""
        return min(c.policy_version for c in self.completions)


@dataclass(frozen=True, slots=True)
class GroupHeader:
    """What the controller needs of a pushed group to judge it (accept, drop as stale or as a
    duplicate, filter, record as a validation answer) and to batch it, without its tokens."""

    prompt: Prompt
    """The group's prompt (requeued as it is when the group is dropped as stale)."""
    policy_version: int
    """:attr:`RolloutGroup.policy_version`."""
    num_tokens: int
    """Response tokens over all completions."""
    filtered: bool
    """Dynamic sampling dropped the group on the rollout (`extra["filtered"]`)."""
    failed: bool
    """The rollout could not generate it (`"error"` in `extra`; validation prompts)."""
    rewards: list[float]
    """Reward of each completion, [n_generation]."""
    lengths: list[int]
    """Response tokens of each completion, [n_generation]."""
    versions: list[int]
    """:attr:`Completion.policy_version` of each completion, [n_generation]."""
    distance: float | None = None
    """A world model's group: its samples' mean distance to the data (`extra["data_distance"]`,
    `nebula_rl.flow.local.data_distance`); None for a language model's."""

    @classmethod
    def of(cls, group: RolloutGroup) -> GroupHeader:
        """The header of `group`."""
        lengths = [len(c.token_ids) for c in group.completions]
        return cls(
            group.prompt,
            group.policy_version,
            sum(lengths),
            bool(group.extra.get("filtered")),
            "error" in group.extra,
            group.rewards,
            lengths,
            [c.policy_version for c in group.completions],
            group.extra.get("data_distance"),
        )


def to_json(obj: Prompt | RolloutGroup | GroupHeader) -> str:
    """Serialise a wire object."""
    return json.dumps(asdict(obj), separators=(",", ":"))


def from_json(
    kind: type[Prompt] | type[RolloutGroup] | type[GroupHeader], text: str | bytes
) -> Any:
    """Inverse of :func:`to_json` for the given type."""
    data = json.loads(text)
    if kind is Prompt:
        return Prompt(**data)
    if kind is GroupHeader:
        data["prompt"] = Prompt(**data["prompt"])
        return GroupHeader(**data)
    if kind is RolloutGroup:
        data["prompt"] = Prompt(**data["prompt"])
        data["completions"] = [
            Completion(**{**c, "version_changes": [tuple(v) for v in c["version_changes"]]})
            for c in data["completions"]
        ]
        return RolloutGroup(**data)
    raise TypeError(f"cannot decode {kind!r}")
