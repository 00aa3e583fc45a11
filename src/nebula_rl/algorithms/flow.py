"""RL losses of rectified-flow (diffusion) models, as pure tensor functions.

- FlowGRPO (Liu et al. 2025, arXiv 2505.05470): a clipped ratio per denoising step of the SDE
  sampler (`nebula_rl.flow.sampler`), group-relative advantages, and a KL to a reference model:
  the squared difference of the step means over `2 std_t^2` (`|dt|` times the Gaussians' exact
  KL). cosmos-rl's `--wfm-mode` trainer writes both without the Gaussian's scale (the
  "squared_error" forms: `log_ratio_scale` and `flow_grpo_kl(form=...)`).
- DDRL (arXiv 2512.04332): the same policy term plus `data_beta` x the flow-matching loss on the
  real clip of the same prompt (a forward KL to the data instead of a reverse KL to a reference),
  optionally with the exponential advantage map `A -> -exp(-A)`.
- DiffusionNFT (Zheng et al. 2025): trains on the forward (noising) process with implicit
  positive and negative policies around soft-updated "old" weights; no likelihoods.

Tensors are float32; a batch is B samples, each of any shape [B, ...]. Mean-over-elements
reductions follow the reference implementations. With conditioning frames (image/video-to-video:
some frames of a sample are given, not generated) each takes `free`, 1 on the generated elements
and 0 on the given ones (broadcastable to a sample, e.g. [B, 1, T, 1, 1]): the means run over the
generated elements only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = [
    "NFT_DECAY_SCHEDULES",
    "ddrl_loss",
    "exp_advantages",
    "flow_grpo_kl",
    "flow_grpo_loss",
    "flow_matching_loss",
    "free_fraction",
    "group_advantages",
    "masked_mean",
    "nft_loss",
    "nft_old_decay",
    "soft_update",
]


def masked_mean(values: Tensor, free: Tensor | None = None) -> Tensor:
    """The mean of each sample's elements [B, ...] -> [B]; with `free`, of its generated
    elements only."""
    if free is None:
        return values.flatten(1).mean(dim=1)
    weights = torch.broadcast_to(free.to(values.dtype), values.shape).flatten(1)
    return (values.flatten(1) * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def free_fraction(free: Tensor | None, like: Tensor) -> Tensor:
    """The share of each sample's elements that are generated [B] (1 without `free`): a mean
    over the generated elements times this is the mean over all of them with the given ones 0."""
    if free is None:
        return torch.ones(like.shape[0], dtype=torch.float32, device=like.device)
    return torch.broadcast_to(free.float(), like.shape).flatten(1).mean(dim=1)


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    global_std: bool = False,
    batch_std: float | None = None,
    population_std: bool = False,
    eps: float = 1e-4,
) -> Tensor:
    """Group-relative advantages `(r - mean_group) / (std + eps)` of `rewards` (groups of
    `group_size` consecutive samples), before any clip. The std is each group's, or with
    `global_std` the batch's (`batch_std` when the batch is larger than `rewards`, e.g. split
    over processes); over n - 1 (cosmos-rl, torch's default) or with `population_std` over n
    (flow_grpo and DiffusionNFT, numpy's). A group of one has advantage 0 (its own mean; its
    std is taken as 0, never NaN)."""
    groups = rewards.float().view(-1, group_size)
    if global_std:
        std = batch_std if batch_std is not None else _std(rewards.float(), population_std)
    else:
        std = _std(groups, population_std, dim=1)
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).flatten()


def _std(values: Tensor, population: bool, dim: int | None = None) -> Tensor:
    """The std over `dim` (kept; all elements when None), over n or n - 1 (0 for a single
    value, where n - 1 would give NaN)."""
    keep = dim is not None
    if dim is None:
        values, dim = values.flatten(), 0
    n = values.shape[dim]
    squares = (values - values.mean(dim=dim, keepdim=True)).square().sum(dim=dim, keepdim=keep)
    return (squares / max(n - (0 if population else 1), 1)).sqrt()


def flow_grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    clip_range_high: float | None = None,
    log_ratio_scale: Tensor | float = 1.0,
) -> Tensor:
    """FlowGRPO's policy term of one denoising step: the mean over the batch of
    `max(-A r, -A clip(r, 1 - eps, 1 + eps_high))`, `r = exp(c (log_prob - old_log_prob))` [B]
    (`eps_high` defaults to `eps`; `c` is `log_ratio_scale`, 1 for the Gaussians' ratio;
    cosmos-rl's `--wfm-mode` ratio `exp(mean(-(x' - mu)^2 + (x' - mu_old)^2))` is `c = 2 scale^2`
    times the generated share of the elements, see `nebula_rl.flow.local`)."""
    high = clip_range if clip_range_high is None else clip_range_high
    ratio = torch.exp((log_prob - old_log_prob) * log_ratio_scale)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)
    return torch.maximum(-advantages * ratio, -advantages * clipped).mean()


def flow_grpo_kl(
    mean: Tensor,
    ref_mean: Tensor,
    std: float,
    *,
    free: Tensor | None = None,
    form: str = "gaussian",
) -> Tensor:
    """KL of a step's Gaussian to the reference model's. "gaussian", as FlowGRPO computes it: the
    mean over the batch of `mean_elements((mean - ref_mean)^2) / (2 std^2)`, with the SDE's
    `std_t` (`|dt|` times the exact KL of the two Gaussians of scale `std_t sqrt(|dt|)`).
    "squared_error", as cosmos-rl's `--wfm-mode` trainer: `mean((mean - ref_mean)^2)` over every
    element of the batch, the given (conditioning) elements counting 0."""
    per_sample = masked_mean((mean - ref_mean) ** 2, free)
    if form == "squared_error":
        return (per_sample * free_fraction(free, mean)).mean()
    if form != "gaussian":
        raise ValueError(f"flow_grpo_kl: form {form!r}; 'gaussian' or 'squared_error'")
    return per_sample.div(2 * std**2).mean()


def exp_advantages(advantages: Tensor, *, clip: float = 5.0) -> Tensor:
    """DDRL's `exp_reward` map `A -> -exp(-A)`, then clipped to [-clip, clip] (after the map, as
    cosmos-rl does: the result lies in [-clip, 0), and A = 0 becomes -1)."""
    return (-torch.exp(-advantages)).clamp(-clip, clip)


def flow_matching_loss(
    velocity: Tensor,
    x0: Tensor,
    noise: Tensor,
    sigma: Tensor,
    *,
    weighting: str = "uniform",
    free: Tensor | None = None,
) -> Tensor:
    """The flow-matching (SFT) loss of predicted velocities [B, ...] at `x_sigma = (1 - sigma) x0
    + sigma noise`: the mean of `w(sigma) (v - (noise - x0))^2`; `weighting` "uniform" (w = 1) or
    "edm" (`sigma^2 + (1 - sigma)^2`, the EDM weight of cosmos-rl's data loss written for a
    rectified flow)."""
    error = (velocity.float() - (noise.float() - x0.float())) ** 2
    per_sample = masked_mean(error, free)
    if weighting == "edm":
        per_sample = per_sample * (sigma**2 + (1 - sigma) ** 2)
    elif weighting != "uniform":
        raise ValueError(f"flow_matching_loss: weighting {weighting!r}; 'uniform' or 'edm'")
    return per_sample.mean()


def ddrl_loss(
    policy_loss: Tensor,
    data_loss: Tensor,
    *,
    data_beta: float,
    kl: Tensor | None = None,
    kl_beta: float = 0.0,
) -> Tensor:
    """DDRL's loss: the policy term + `kl_beta` x KL (optional) + `data_beta` x the data
    (flow-matching) loss on the real sample of the same prompt."""
    loss = policy_loss + data_beta * data_loss
    if kl is not None and kl_beta:
        loss = loss + kl_beta * kl
    return loss


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    x_t: Tensor,
    x0: Tensor,
    t: Tensor,
    advantages: Tensor,
    *,
    beta: float,
    adv_clip: float = 5.0,
    v_ref: Tensor | None = None,
    kl_beta: float = 0.0,
    free: Tensor | None = None,
) -> Tensor:
    """DiffusionNFT's loss on noised samples `x_t = (1 - t) x0 + t noise` [B, ...].

    Implicit policies `v+ = beta v_theta + (1 - beta) v_old` and `v- = (1 + beta) v_old - beta
    v_theta`; optimality weight `r = clip(clip(A, -c, c) / c / 2 + 0.5, 0, 1)`; each x0 estimate
    `x0^ = x_t - t v` is scored by its mean squared error over the (detached, float64) mean
    absolute error, floored at 1e-5 (adaptive weighting). Loss: the batch mean of
    `(r L+ + (1 - r) L-) / beta x c`, plus `kl_beta` x mean((v_theta - v_ref)^2)."""
    tb = t.float().view(-1, *[1] * (x0.dim() - 1))
    r = (advantages.float().clamp(-adv_clip, adv_clip) / adv_clip / 2 + 0.5).clamp(0, 1)

    def weighted(v: Tensor) -> Tensor:
        error = (x_t.float() - tb * v.float()) - x0.float()
        weight = masked_mean(error.detach().double().abs(), free).clamp(min=1e-5)
        return masked_mean(error**2, free) / weight.float()

    positive = weighted(beta * v_theta + (1 - beta) * v_old)
    negative = weighted((1 + beta) * v_old - beta * v_theta)
    loss = ((r * positive + (1 - r) * negative) / beta * adv_clip).mean()
    if v_ref is not None and kl_beta:
        loss = loss + kl_beta * masked_mean((v_theta.float() - v_ref.float()) ** 2, free).mean()
    return loss


NFT_DECAY_SCHEDULES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
"""`weight_copy_decay_type` -> (flat steps, rise per step, ceiling) of DiffusionNFT's old-weight
decay, as DiffusionNFT's and cosmos-rl's trainers define them."""


def nft_old_decay(step: int, decay_type: int = 1) -> float:
    """DiffusionNFT's decay of the old weights at training step `step`: 0 for the first `flat`
    steps, then `min(rise (step - flat), ceiling)` (type 0: always 0, the old weights become
    the current ones; type 1: `min(0.001 step, 0.5)`; type 2: from step 75, up to 0.999)."""
    if decay_type not in NFT_DECAY_SCHEDULES:
        raise ValueError(f"nft_old_decay: decay type {decay_type}; one of 0, 1, 2")
    flat, rise, ceiling = NFT_DECAY_SCHEDULES[decay_type]
    return 0.0 if step < flat else min((step - flat) * rise, ceiling)


@torch.no_grad()
def soft_update(old: nn.Module, new: nn.Module, *, decay: float) -> None:
    """`old <- decay old + (1 - decay) new`, parameter by parameter (same architecture)."""
    for target, source in zip(old.parameters(), new.parameters(), strict=True):
        target.lerp_(source.detach(), 1.0 - decay)
