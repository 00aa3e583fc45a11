"""Types shared by the RL variants: settings, the batch, and the registry entry.

Each variant turns a `PolicyBatch` into a per-token policy-gradient loss [B, T] and hands it to
`regularizers.finish_loss`. The settings and the batch are frozen, slotted dataclasses whose
fields document their shapes and units.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from nebula_rl.algorithms.aggregation import LOSS_TYPES


@dataclass(frozen=True, slots=True)
class LossSettings:
    """The knobs of the RL losses, built from `[train.train_policy]`."""

    epsilon_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - epsilon_low; negative: no lower clip."""
    epsilon_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + epsilon_high (DAPO clip-higher: 0.28);
    negative: no upper clip."""
    lower_bound_ratio: float | None = 3.0
    """Dual clip: for A < 0 the token loss is at most lower_bound_ratio * |A|; None disables."""
    loss_type: str = "token-mean"
    """How per-token losses are averaged; one of `LOSS_TYPES`."""
    kl_beta: float = 0.0
    """Coefficient of the k3 KL penalty to the reference policy; 0 needs no reference."""
    unbiased_kl_estimate: bool = False
    """Weight the k3 KL by pi_theta / pi_old (DeepSeek-V3.2), see `importance_weighted_k3_kl`."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (subtracted from the loss)."""
    aipo_rho: float | None = None
    """AIPO: truncation of the off-policy importance weight; when set, the loss is AIPO's for
    every token-ratio variant (see `policy_loss`)."""
    behaviour_weight_cap: float | None = None
    """Decoupled PPO: tokens whose weight pi_prox / pi_behaviour exceeds this are dropped."""
    max_tokens: int | None = None
    """Dr.GRPO: the constant per-sequence divisor of "seq-mean-token-sum-norm" (and of
    "seq-mean-token-mean" when set), in tokens."""
    normalize_std: bool = True
    """GRPO advantages divide by the group's std; False is Dr.GRPO (centre only)."""
    advantage_low: float = -5.0
    """Advantages are clipped below at this value."""
    advantage_high: float = 5.0
    """Advantages are clipped above at this value."""
    off_policy_masking_delta: float | None = None
    """DeepSeek-V3.2: a negative-advantage sequence whose mean log(pi_old / pi_theta) exceeds
    this gets no policy loss; None disables (see `off_policy_sequence_mask`)."""

    def __post_init__(self) -> None:
        if self.advantage_low > self.advantage_high:
            raise ValueError(
                f"train.train_policy.advantage_low ({self.advantage_low}) must not exceed "
                f"advantage_high ({self.advantage_high})"
            )
        if self.lower_bound_ratio is not None and self.lower_bound_ratio <= 1.0:
            raise ValueError(
                f"train.train_policy.lower_bound_ratio must be > 1, got {self.lower_bound_ratio}"
            )
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"train.train_policy.loss_type must be one of {list(LOSS_TYPES)}, "
                f"got {self.loss_type!r}"
            )
        if self.loss_type == "seq-mean-token-sum-norm" and (
            self.max_tokens is None or self.max_tokens <= 0
        ):
            raise ValueError(
                "train.train_policy.unbiased_loss_max_tokens (or rollout.max_response_length) "
                f"must be > 0 with loss_type 'seq-mean-token-sum-norm', got {self.max_tokens}"
            )
        for name in ("aipo_rho", "behaviour_weight_cap"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"train.train_policy.{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class PolicyBatch:
    """One micro-batch of scored tokens; B sequences of T positions, already aligned."""

    logprobs: Tensor
    """[B, T] log pi_theta of each sampled token, from the trainer's forward (carries grad)."""
    old_logprobs: Tensor
    """[B, T] log-probs of the proximal policy: recomputed by the trainer at step start, or the
    rollout's (`use_rollout_logprobs_for_loss`)."""
    advantages: Tensor
    """[B] one advantage per sequence, or [B, T] one per token (on-policy distillation adds a
    per-token term); see `token_advantages`."""
    mask: Tensor
    """[B, T] float, 1 on completion tokens, 0 on prompt and padding."""
    behaviour_logprobs: Tensor | None = None
    """[B, T] log-probs the rollout engine sampled with; None when on-policy."""
    ref_logprobs: Tensor | None = None
    """[B, T] log-probs of the frozen reference policy; needed when kl_beta != 0."""
    entropy: Tensor | None = None
    """[B, T] per-token entropy of pi_theta; needed when entropy_coef != 0 (then it carries
    grad), optional otherwise (logged only)."""


def token_advantages(batch: PolicyBatch) -> Tensor:
    """The batch's advantages broadcastable to [B, T]: [B, 1] or [B, T]."""
    a = batch.advantages
    return a.unsqueeze(-1) if a.dim() == 1 else a


def sequence_advantages(batch: PolicyBatch) -> Tensor:
    """[B] each sequence's advantage: per-token advantages averaged over its masked tokens."""
    a = batch.advantages
    if a.dim() == 1:
        return a
    return (a * batch.mask).sum(dim=-1) / batch.mask.sum(dim=-1).clamp(min=1.0)


class AdvantageFn(Protocol):
    """rewards [num_groups, group_size] -> advantages [num_groups, group_size]."""

    def __call__(self, rewards: Tensor, settings: LossSettings) -> Tensor: ...


class LossFn(Protocol):
    """A variant's loss: scalar to minimise plus detached scalar metrics."""

    def __call__(
        self,
        batch: PolicyBatch,
        settings: LossSettings,
        *,
        num_tokens: float,
        num_sequences: float,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


@dataclass(frozen=True, slots=True)
class Algorithm:
    """One entry of `ALGORITHMS`: what a `[train.train_policy] variant` computes."""

    advantages: AdvantageFn
    """Group rewards to per-sample advantages."""
    loss: LossFn
    """The policy loss."""
    keep_groups: Callable[[Tensor], Tensor]
    """rewards [num_groups, group_size] -> bool [num_groups]: groups worth training on."""
    defaults: LossSettings
    """The paper's settings; the config layer overrides them field by field."""
