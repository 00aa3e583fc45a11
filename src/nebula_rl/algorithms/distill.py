"""On-policy distillation: the teacher's per-token divergence as an advantage.

The student samples; a teacher scores the student's tokens; each token's divergence between
student and teacher enters the policy gradient as a penalty on that token's advantage,

    A_t += -kl_penalty_coef * d_t        (or its discounted future sum, gamma = kl_discount_factor)

and the variant's clipped policy loss applies unchanged (Agarwal et al. 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649;
Thinking Machines' "On-Policy Distillation", 2025; cosmos-rl's `[distillation]`).

- `top_k = 0`: d_t = log pi_student(y_t) - log pi_teacher(y_t) at the sampled token, a
  one-sample estimate of the reverse KL(student || teacher).
- `top_k > 0`: d_t is the generalised Jensen-Shannon divergence over the teacher's k most likely
  tokens at position t, summed over those k (`jsd_beta` 0: forward KL(teacher || student),
  1: reverse KL(student || teacher), between: the divergences to the mixture
  M = beta * teacher + (1 - beta) * student, beta * KL(teacher || M) + (1 - beta) *
  KL(student || M)), as in GKD (Agarwal et al.) and cosmos-rl.

The divergence is a constant in the gradient (it is a reward, not a loss term).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "discounted_future_sum",
    "distillation_advantages",
    "sampled_token_divergence",
    "top_k_divergence",
]


def sampled_token_divergence(student_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """[B, T] log pi_student - log pi_teacher of the sampled tokens (`top_k = 0`)."""
    return student_logprobs.detach() - teacher_logprobs


def top_k_divergence(student_logprobs: Tensor, teacher_logprobs: Tensor, *, beta: float) -> Tensor:
    """[B, T] generalised JSD summed over the teacher's top k tokens.

    Args:
        student_logprobs: [B, T, K] log pi_student of the teacher's k tokens at each position.
        teacher_logprobs: [B, T, K] log pi_teacher of the same tokens.
        beta: `jsd_beta` in [0, 1].
    """
    s, t = student_logprobs.detach().float(), teacher_logprobs.float()
    if beta == 0.0:  # forward KL(teacher || student)
        terms = t.exp() * (t - s)
    elif beta == 1.0:  # reverse KL(student || teacher)
        terms = s.exp() * (s - t)
    else:
        mixture = torch.logsumexp(
            torch.stack([s + math.log(1.0 - beta), t + math.log(beta)]), dim=0
        )
        terms = beta * t.exp() * (t - mixture) + (1.0 - beta) * s.exp() * (s - mixture)
    return terms.sum(dim=-1)


def discounted_future_sum(values: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """[B, T] sum over the masked positions u >= t of gamma^(rank of u - rank of t) * values[u],
    0 off `mask` (values [B, T], mask [B, T] float)."""
    out = torch.zeros_like(values)
    running = values.new_zeros(values.shape[0])
    for t in range(values.shape[1] - 1, -1, -1):
        on = mask[:, t] > 0
        running = torch.where(on, values[:, t] + gamma * running, running)
        out[:, t] = torch.where(on, running, torch.zeros_like(running))
    return out


def distillation_advantages(
    divergence: Tensor, mask: Tensor, *, kl_penalty_coef: float, kl_discount_factor: float
) -> Tensor:
    """[B, T] per-token advantage term -kl_penalty_coef * divergence, replaced by its
    discounted future sum when `kl_discount_factor` != 0; 0 off `mask`."""
    shaped = -kl_penalty_coef * divergence * mask
    if kl_discount_factor != 0.0:
        shaped = discounted_future_sum(shaped, mask, kl_discount_factor)
    return shaped
