"""GSPO: sequence-level importance ratio, clipped per sequence.

Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071). The importance
ratio of a completion is the geometric mean of its token ratios,
s_i = exp(mean_t (log pi_theta - log pi_old)), so one off-policy token cannot dominate, and the
whole sequence is clipped with GSPO's own, much smaller, clip ranges (3e-4 / 4e-4 in the paper).
We use the paper's token form (GSPO-token, Sec. 4.3)
s_i,t = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)), whose value is s_i at every token and
whose gradient, averaged over a sequence's tokens ("seq-mean-token-mean"), equals the gradient
of the sequence form s_i * A_i. Advantages are GRPO's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nebula_rl.algorithms.base import LossSettings, PolicyBatch
from nebula_rl.algorithms.grpo import clipped_policy_loss


def gspo_sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log s_i = masked mean over tokens of (logprobs - old_logprobs): [B, T] -> [B].

    A sequence without tokens gets 0 (ratio 1).
    """
    log_ratio = (logprobs - old_logprobs.detach()) * mask
    return log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)


def gspo_token_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token ratio s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)), [B, T].

    Its value is s_i on every token; its gradient at token t is s_i * grad log pi_theta(y_t).
    """
    seq_log_ratio = gspo_sequence_log_ratio(logprobs, old_logprobs, mask).detach()
    return torch.exp(seq_log_ratio.unsqueeze(-1) + logprobs - logprobs.detach())


def gspo_loss(
    batch: PolicyBatch, settings: LossSettings, *, num_tokens: float, num_sequences: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO policy loss: PPO-clip of the sequence ratio (then decoupled weight, KL, entropy).

    Same arguments and metrics as `grpo_loss`; use loss_type "seq-mean-token-mean" for the
    paper's objective.
    """
    ratio = gspo_token_ratio(batch.logprobs, batch.old_logprobs, batch.mask)
    return clipped_policy_loss(
        ratio, batch, settings, num_tokens=num_tokens, num_sequences=num_sequences
    )
