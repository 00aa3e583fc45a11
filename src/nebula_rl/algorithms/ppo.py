"""The PPO-clip surrogate and the decoupled off-policy weight, per token.

- PPO-clip (Schulman et al. 2017, arXiv:1707.06347) with separate lower and upper clip ranges
  ("clip-higher", DAPO, Yu et al. 2025, arXiv:2503.14476, Sec. 3.1); as in cosmos-rl, a
  negative range turns the clip off on its side (both negative: the plain surrogate -A * r).
- Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
  Learning", arXiv:1912.09729): for A < 0 the clipped surrogate is unbounded as the ratio grows;
  the token loss is capped at lower_bound_ratio * |A|.
- Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization",
  arXiv:2110.00641; used for asynchronous RL by AReaL, Fu et al. 2025, arXiv:2505.24298): the
  clip is taken against the proximal policy (recomputed by the trainer), and each token is
  weighted by the detached importance weight pi_prox / pi_behaviour of the policy that actually
  sampled it. As in AReaL, tokens whose weight exceeds the cap are dropped (weight 0).
"""

from __future__ import annotations

import torch
from torch import Tensor


def ppo_clip_loss(
    ratio: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    lower_bound_ratio: float | None,
) -> tuple[Tensor, Tensor]:
    """Per-token clipped surrogate loss (to minimise) and where a clip is active.

    loss = max(-A * r, -A * clip(r, 1 - epsilon_low, 1 + epsilon_high)); with dual clip, for
    A < 0 the loss is further bounded by lower_bound_ratio * |A|. Clipped tokens get no gradient.

    Args:
        ratio: [B, T] pi_theta / pi_old (carries grad).
        advantages: advantages broadcastable to `ratio`, e.g. [B, 1].
        epsilon_low: lower clip range; negative: no lower clip.
        epsilon_high: upper clip range; negative: no upper clip.
        lower_bound_ratio: dual-clip constant (> 1), None to disable.

    Returns:
        (loss [B, T], bool [B, T] true where the clip or the dual clip sets the loss).
    """
    unclipped = -advantages * ratio
    low = 1.0 - epsilon_low if epsilon_low >= 0 else None
    high = 1.0 + epsilon_high if epsilon_high >= 0 else None
    clipped_ratio = ratio if low is None and high is None else ratio.clamp(low, high)
    clipped = -advantages * clipped_ratio
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if lower_bound_ratio is not None:
        bound = -advantages * lower_bound_ratio  # = lower_bound_ratio * |A| where A < 0
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        is_clipped = is_clipped | dual
    return loss, is_clipped


def decoupled_weight(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, *, cap: float | None
) -> Tensor:
    """Detached per-token weight pi_prox / pi_behaviour; 0 where it exceeds `cap` (if given).

    Args:
        old_logprobs: [B, T] log-probs of the proximal policy (trainer, step start).
        behaviour_logprobs: [B, T] log-probs the rollout engine sampled with.
        cap: drop tokens whose weight exceeds this; None keeps every token.
    """
    weight = torch.exp(old_logprobs.detach() - behaviour_logprobs.detach())
    if cap is not None:
        weight = torch.where(weight <= cap, weight, torch.zeros_like(weight))
    return weight
