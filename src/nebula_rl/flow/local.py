"""World-model RL in one process: FlowGRPO, DDRL and DiffusionNFT on a flow model and a video/caption dataset,
read top to bottom. Its two halves, :func:`roll_out` and :func:`train_on_batch`, are what the
runtime's rollout and policy replicas run (`nebula_rl.flow.runtime`).

An iteration: pick `prompts_per_iteration` captions; sample `group_size` clips per caption with
the SDE sampler, recording each trajectory; score the final samples (a reward function here, or
the reward service through `nebula_rl.rewards.remote`); turn rewards into group-relative
advantages; then replay the first `timestep_fraction` of each trajectory's steps (or the steps
`train_on` picks) under the current weights, in `num_minibatches` optimiser steps, with
FlowGRPO's clipped ratio per step. With `kl_beta`, the KL's reference is the starting weights,
or the weights of every `reference_reset_interval`-th iteration.
DDRL adds `data_beta` x the flow-matching loss of a real clip of the same caption, noised to
the same step's sigma with the rollout's own start noise (cosmos-rl's `use_rl_sigma_and_noise`).

DiffusionNFT (`algorithm = "nft"`) keeps only the generated samples and their advantages: it
noises them afresh at the rollout's noise levels and trains the implicit positive and negative
policies around a copy of the "old" weights, soft-updated after each optimiser step (or once an
iteration, as cosmos-rl does: `nft_old_update`).

:func:`pretrain` is the SFT warm start: plain flow matching on the dataset's clips.

A latent-space model (a diffusers transformer with its VAE, `nebula_rl.flow.vae`) samples,
records and trains on latents throughout: the trajectories, log-probabilities and losses are
those of its latents, and the real clips are encoded only where a loss needs them (SFT, DDRL's
data term). The final latents are decoded to pixels for the rewards and the distance to the data
only.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from nebula_rl.algorithms.flow import (
    ddrl_loss,
    exp_advantages,
    flow_grpo_kl,
    flow_grpo_loss,
    flow_matching_loss,
    free_fraction,
    group_advantages,
    nft_loss,
    nft_old_decay,
    soft_update,
)
from nebula_rl.flow.data import Clip, clip_batch, clip_pixels, clip_text
from nebula_rl.flow.diffusers_models import DiffusersFlowModel
from nebula_rl.flow.sampler import (
    Trajectory,
    context_frames,
    guided_velocity,
    keep_given,
    sample,
    sde_step,
)
from nebula_rl.flow.text_encoder import flow_text_encoder
from nebula_rl.flow.vae import pixels_to_samples, sample_shape, samples_to_pixels
from nebula_rl.utils.ranks import cpu_threads

__all__ = [
    "FlowBatch",
    "FlowRLSettings",
    "RewardFn",
    "data_distance",
    "flow_advantages",
    "given_frames",
    "pooled_std",
    "pretrain",
    "rl_iteration",
    "roll_out",
    "rollout_velocity",
    "run_flow_rl",
    "sft_sigmas",
    "sft_step",
    "train_on_batch",
]

log = logging.getLogger(__name__)

RewardFn = Callable[[Tensor, Sequence[str]], list[float] | None]
"""`score(pixels in [-1, 1] [B, 3, T, H, W], prompts) -> rewards` (a latent-space model's samples
decoded), None when the rewards were lost (the group then gets advantage 0)."""


@dataclass(frozen=True, slots=True)
class FlowRLSettings:
    """One run of :func:`run_flow_rl`."""

    algorithm: Literal["flow_grpo", "ddrl", "nft"] = "flow_grpo"
    num_iterations: int = 60
    prompts_per_iteration: int = 4
    group_size: int = 8
    sample_steps: int = 10
    """SDE steps of a rollout (FlowGRPO's denoising reduction)."""
    noise_level: float = 0.7
    timestep_fraction: float = 0.99
    """The first int(sample_steps x this) steps of each trajectory are trained."""
    train_on: tuple[int, ...] | None = None
    """The trained steps by index instead (each -1: one more drawn every iteration from the
    steps not named)."""
    same_group_noise: bool = False
    """The samples of a group start from one noise (the SDE's step noise still differs)."""
    reference_reset_interval: int = 0
    """Every this many iterations the KL reference takes the current weights (0: never)."""
    reset_optimizer_with_reference: bool = True
    """Clear the optimiser's moments when the reference is reset."""
    num_minibatches: int = 2
    """Optimiser steps per iteration (the later ones are slightly off-policy: the clip acts)."""
    clip_range: float = 1e-4
    """The ratio's clip below 1 (FlowGRPO's 1e-4)."""
    clip_range_high: float | None = None
    """The ratio's clip above 1 (None: `clip_range`)."""
    kl_beta: float = 0.0
    """Weight of FlowGRPO's KL to the starting weights (a frozen copy); 0 for none."""
    ratio_form: Literal["gaussian", "squared_error"] = "gaussian"
    """The log-ratio of a step: the Gaussians' log-densities (flow_grpo), or cosmos-rl's
    `--wfm-mode` squared errors without the Gaussian's 1 / (2 scale^2)."""
    kl_form: Literal["gaussian", "squared_error"] = "gaussian"
    """The KL: flow_grpo's mean squared difference of the means over 2 std_t^2, or cosmos-rl's
    `--wfm-mode` mean squared difference."""
    global_std: bool = False
    """Normalise advantages by the std of the whole batch instead of each group's."""
    population_std: bool = False
    """That std over n (flow_grpo, DiffusionNFT) instead of n - 1 (cosmos-rl)."""
    detach_unconditional: bool = False
    """Train through the conditional branch of classifier-free guidance only (the unconditional
    one detached); False trains through both, as flow_grpo and cosmos-rl do."""
    shift: float = 1.0
    """The sampler's sigma-schedule shift (SD3's; 1: uniform)."""
    lr: float = 1e-3
    grad_clip: float = 1.0
    adv_clip: float = 5.0
    data_beta: float = 0.0
    """DDRL's weight of the data (flow-matching) loss; 0 for FlowGRPO."""
    exp_reward: bool = False
    """DDRL's advantage map A -> -exp(-A)."""
    nft_beta: float = 1.0
    """DiffusionNFT's beta: how far the implicit policies lie from the old weights."""
    nft_decay_type: int = 1
    """DiffusionNFT's old-weight decay schedule (`weight_copy_decay_type`, see
    `nebula_rl.algorithms.flow.nft_old_decay`)."""
    nft_old_update: Literal["iteration", "minibatch"] = "minibatch"
    """When the old weights follow: after each optimiser step, or once an iteration, after all
    its optimiser steps (cosmos-rl's schedule)."""
    guidance_scale: float = 1.0
    solver: str = "euler"
    """Rollouts' ODE solver at noise level 0: "euler" or "dpm2" (DPM-Solver++(2M))."""
    conditional_frames: tuple[int, int] = (0, 0)
    """(fewest, most) leading frames of each sample given clean, from its prompt's real clip
    (image/video-to-video); each group draws its count uniformly between the two."""
    seed: int = 0
    rollout_threads: int | None = None
    """torch's CPU threads while sampling (`rollout.cpu_threads`; None: unchanged)."""
    train_threads: int | None = None
    """torch's CPU threads while training (`policy.cpu_threads`; None: unchanged)."""


def sft_sigmas(
    n: int,
    generator: torch.Generator,
    *,
    scheme: str = "uniform",
    mean: float = 0.0,
    std: float = 1.0,
) -> Tensor:
    """Noise levels of flow-matching SFT: uniform, or SD3's `logit_normal` (the sigmoid of a
    normal with `mean` and `std`)."""
    if scheme == "uniform":
        return torch.rand(n, generator=generator)
    if scheme == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn(n, generator=generator))
    raise ValueError(f"weighting_scheme {scheme!r}: 'uniform' or 'logit_normal'")


def pretrain(
    model: nn.Module,
    clips: list[Clip],
    *,
    steps: int,
    lr: float = 2e-3,
    batch_size: int = 32,
    seed: int = 0,
    batches: Callable[[int], list[Clip]] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    sigma_scheme: str = "uniform",
    sigma_mean: float = 0.0,
    sigma_std: float = 1.0,
    grad_clip: float | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    start: int = 1,
    generator: torch.Generator | None = None,
    conditional_frames: tuple[int, int] = (0, 0),
) -> list[float]:
    """Flow-matching SFT: steps `start`..`steps` (optimiser steps) on `batches(step)` (default:
    `batch_size` random clips, encoded by a latent-space model's VAE), noise levels from
    :func:`sft_sigmas`, noise from `generator` (default: seeded by `seed`); the losses. With
    `conditional_frames` (fewest, most), each clip's first frames, their count drawn per clip,
    are given clean and the model told so; the loss runs over the other frames."""
    generator = generator or torch.Generator().manual_seed(seed)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(start, steps + 1):
        if batches is not None:
            chosen = batches(step)
        else:
            picks = torch.randint(len(clips), (batch_size,), generator=generator)
            chosen = [clips[int(i)] for i in picks]
        loss = sft_step(
            model, chosen, optimizer, generator, scheduler=scheduler, sigma_scheme=sigma_scheme,
            sigma_mean=sigma_mean, sigma_std=sigma_std, grad_clip=grad_clip,
            conditional_frames=conditional_frames,
        )  # fmt: skip
        losses.append(loss)
        if on_step is not None:
            on_step({"step": float(step), "loss": loss})
    return losses


def sft_step(
    model: nn.Module,
    chosen: list[Clip],
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    sigma_scheme: str = "uniform",
    sigma_mean: float = 0.0,
    sigma_std: float = 1.0,
    grad_clip: float | None = None,
    conditional_frames: tuple[int, int] = (0, 0),
) -> float:
    """One flow-matching optimiser step on the clips `chosen` (see :func:`pretrain`); its
    loss."""
    device = next(model.parameters()).device
    x0, text, mask = (t.to(device) for t in clip_batch(chosen, flow_text_encoder(model)))
    x0 = pixels_to_samples(model, x0)
    noise = torch.randn(x0.shape, generator=generator).to(device)
    sigma = sft_sigmas(
        len(chosen), generator, scheme=sigma_scheme, mean=sigma_mean, std=sigma_std
    ).to(device)
    s = sigma.view(-1, *[1] * (x0.dim() - 1))
    noised = (1 - s) * x0 + s * noise
    given = given_frames(x0.shape[2], len(chosen), conditional_frames, generator, device)
    free = context_frames(given)
    extra: tuple[Tensor, ...] = ()
    if given is not None:  # (passed even when none is: every FSDP2 rank runs the same)
        noised = keep_given(noised, x0, free)
        extra = (given.float(),)
    loss = flow_matching_loss(model(noised, sigma, text, mask, *extra), x0, noise, sigma, free=free)
    optimizer.zero_grad()
    loss.backward()
    if grad_clip:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def data_distance(pixels: Tensor, prompts: Sequence[str], clips: list[Clip]) -> float | None:
    """Mean over samples (`pixels` in [-1, 1], a latent-space model's decoded) of the RMS distance
    to the nearest clip of the same caption: how far generation has moved from the data; None
    for a prompt dataset (no clips)."""
    by_caption: dict[str, list[Tensor]] = {}
    for clip in clips:
        if clip.video is None:
            return None
        by_caption.setdefault(clip.caption, []).append(clip.samples())
    total = 0.0
    for x, prompt in zip(pixels.float().cpu(), prompts, strict=True):
        real = torch.stack(by_caption[prompt])
        total += float(((real - x) ** 2).flatten(1).mean(dim=1).sqrt().min())
    return total / len(prompts)


def pooled_std(total: float, squares: float, count: float, *, population: bool = False) -> float:
    """The std of `count` rewards from their sum and sum of squares (over `count - 1`, or over
    `count` with `population`): the batch-wide std of rewards summed over processes."""
    divisor = max(count - (0 if population else 1), 1)
    return max((squares - total * total / count) / divisor, 0.0) ** 0.5


def flow_advantages(
    rewards: Tensor, group_size: int, s: FlowRLSettings, *, batch_std: float | None = None
) -> Tensor:
    """Group-relative advantages of `rewards` (groups of `group_size` consecutive samples): the
    reward less its group's mean, over the group's std (with `global_std`, the batch's:
    `batch_std` when the batch is larger than `rewards`, e.g. split over processes; over n with
    `population_std`), clipped to `adv_clip`; DDRL's `exp_reward` maps them through -exp(-A)."""
    a = group_advantages(
        rewards, group_size, global_std=s.global_std, batch_std=batch_std,
        population_std=s.population_std,
    )  # fmt: skip
    return exp_advantages(a, clip=s.adv_clip) if s.exp_reward else a.clamp(-s.adv_clip, s.adv_clip)


@dataclass
class FlowBatch:
    """Rollouts to train on: captions, their real clips, trajectories and advantages."""

    prompts: list[str]
    x0: Tensor | None
    """The real clip of each sample's caption as the model's samples [B, C, T, H, W] (DDRL's
    data term; None without it)."""
    text: Tensor
    mask: Tensor
    trajectory: Trajectory
    advantages: Tensor
    noise_seeds: list[int] | None = None
    """DiffusionNFT: a seed per sample for the noise it is trained with at each step (so the
    noise follows the sample, not the order of draws: a batch split over processes trains as
    one); None draws from the loop's generator."""


def _nft_noise(batch: FlowBatch, part: Tensor, step: int, generator: torch.Generator) -> Tensor:
    """The noise of the samples `part` at trained step `step`."""
    shape = batch.trajectory.final.shape[1:]
    if batch.noise_seeds is None:
        return torch.randn(len(part), *shape, generator=generator)
    return torch.stack(
        [
            torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            for seed in (batch.noise_seeds[int(i)] * 1009 + step for i in part)
        ]
    )


def given_frames(
    frames: int,
    draws: int,
    conditional_frames: tuple[int, int],
    generator: torch.Generator,
    device: torch.device,
    *,
    repeat: int = 1,
) -> Tensor | None:
    """Which of `frames` frames are given, [draws x repeat, frames] (bool): the first k, k drawn
    `draws` times uniformly between `conditional_frames` (fewest, most), each draw for `repeat`
    samples in a row (a group's); None without conditioning."""
    lowest, most = conditional_frames
    if most >= frames:
        raise ValueError(
            f"policy.diffusers.max_num_conditional_frames ({most}) must be below the frames of "
            f"the model's samples ({frames}): at least one frame is generated"
        )
    if most <= 0:
        return None
    counts = torch.randint(
        lowest, most + 1, (draws,), generator=generator, device=generator.device
    ).cpu().repeat_interleave(repeat)  # fmt: skip
    return (torch.arange(frames)[None] < counts[:, None]).to(device)


def roll_out(
    model: nn.Module, real: list[Clip], s: FlowRLSettings, generator: torch.Generator
) -> tuple[Tensor | None, Tensor, Tensor, Trajectory]:
    """Sample one trajectory per entry of `real` (a caption's clip, repeated `group_size` times
    per caption) with the SDE sampler: (the clips as the model's samples where DDRL's data term
    needs them, else None; text, mask, trajectory). With `conditional_frames`, each group's
    first frames (their count drawn per group) are its clip's, given clean."""
    device = next(model.parameters()).device
    text, mask = (t.to(device) for t in clip_text(real, flow_text_encoder(model)))
    shape = (len(real), *sample_shape(model, real[0].shape))
    groups = len(real) // s.group_size
    if s.same_group_noise:  # (one start per group)
        noise = torch.randn((groups, *shape[1:]), generator=generator, device=generator.device)
        noise = noise.repeat_interleave(s.group_size, dim=0).to(device)
    else:
        noise = torch.randn(shape, generator=generator, device=generator.device).to(device)
    given = given_frames(
        shape[2], groups, s.conditional_frames, generator, device, repeat=s.group_size
    )
    x0 = None  # (the clips as samples: the given frames' and DDRL's data)
    if given is not None or s.data_beta > 0:
        x0 = pixels_to_samples(model, clip_pixels(real).to(device))
    clean = None if given is None else x0
    training = model.training
    model.eval()
    with torch.no_grad():
        trajectory = sample(
            rollout_velocity(model, text, mask, s, given=given), noise,
            num_steps=s.sample_steps, noise_level=s.noise_level, shift=s.shift,
            generator=generator, solver=s.solver, given=given, clean=clean,
        )  # fmt: skip
    model.train(training)
    return (x0 if s.data_beta > 0 else None), text, mask, trajectory


def train_on_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: FlowBatch,
    s: FlowRLSettings,
    generator: torch.Generator,
    *,
    iteration: int,
    reference: nn.Module | None = None,
    old: nn.Module | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    sync_grads: Callable[[], None] | None = None,
) -> tuple[list[float], float]:
    """One iteration's training on `batch`: DiffusionNFT when `old` (its "old" weights) is
    given, else FlowGRPO (DDRL with `data_beta`; the KL to `reference` with `kl_beta`), in
    `num_minibatches` optimiser steps; (each minibatch's loss, the fraction of clipped ratios).
    `sync_grads` runs before each update (e.g. to sum the gradients of data-parallel replicas
    that trained on other groups)."""
    model.train()
    if reference is not None and _reference_due(s, iteration):
        reference.load_state_dict(model.state_dict())
        if s.reset_optimizer_with_reference:
            optimizer.state.clear()
    if old is not None:
        return _train_nft(
            model, old, optimizer, batch, s, generator, iteration, scheduler, sync_grads
        )
    return _train_flow_grpo(model, optimizer, batch, s, generator, reference, scheduler, sync_grads)


def run_flow_rl(
    model: nn.Module,
    clips: list[Clip],
    settings: FlowRLSettings,
    *,
    score: RewardFn,
    on_iteration: Callable[[dict[str, float]], None] | None = None,
    prompt_clips: Callable[[int], list[Clip]] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    start: int = 1,
    generator: torch.Generator | None = None,
    old: nn.Module | None = None,
    reference: nn.Module | None = None,
) -> list[dict[str, float]]:
    """Train `model` with FlowGRPO, DDRL or DiffusionNFT on the captions of `clips`; one record
    per iteration (reward mean, data distance, loss, the fraction of clipped ratios).

    Iterations `start`..`num_iterations` run (a resumed run starts later), their noise drawn
    from `generator` (default: seeded by `seed`). DiffusionNFT's old weights and the KL
    reference are copies of `model` made here unless given (`old`, `reference`).

    Each iteration's prompts are the captions of `prompt_clips(iteration)` (default:
    `prompts_per_iteration` distinct random captions), each sampled `group_size` times; DDRL's
    real clip of a sample is its prompt's clip. `optimizer` and `scheduler` default to AdamW at
    `lr`, constant; the scheduler steps once per optimiser step."""
    s = settings
    if s.algorithm == "ddrl" and s.data_beta <= 0:
        raise ValueError("ddrl: data_beta must be > 0 (with 0 it is FlowGRPO)")
    rng = random.Random(s.seed)
    generator = generator or torch.Generator().manual_seed(s.seed)
    captions = sorted({c.caption for c in clips})
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    if old is None and s.algorithm == "nft":
        old = copy.deepcopy(model).requires_grad_(False)
    if reference is None and s.kl_beta > 0:
        reference = copy.deepcopy(model).requires_grad_(False)
    records = []
    for iteration in range(start, s.num_iterations + 1):
        if prompt_clips is not None:
            real = [c for c in prompt_clips(iteration) for _ in range(s.group_size)]
        else:
            chosen = rng.sample(captions, min(s.prompts_per_iteration, len(captions)))
            real = [
                rng.choice([c for c in clips if c.caption == p])
                for p in chosen
                for _ in range(s.group_size)
            ]
        record = rl_iteration(
            model, real, clips, s, iteration, score=score, optimizer=optimizer,
            scheduler=scheduler, generator=generator, old=old, reference=reference,
        )  # fmt: skip
        records.append(record)
        if on_iteration is not None:
            on_iteration(record)
    return records


def rl_iteration(
    model: nn.Module,
    real: list[Clip],
    clips: list[Clip],
    s: FlowRLSettings,
    iteration: int,
    *,
    score: RewardFn,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    generator: torch.Generator,
    old: nn.Module | None,
    reference: nn.Module | None,
) -> dict[str, float]:
    """One RL iteration on the captions of `real`, one entry per sample (`group_size` in a row
    per prompt; DDRL's real clip of a sample is its entry): sample, score, train; its record
    (reward mean, data distance to `clips`, loss, the fraction of clipped ratios)."""
    prompts = [c.caption for c in real]
    with cpu_threads(s.rollout_threads):
        x0, text, mask, trajectory = roll_out(model, real, s, generator)
    pixels = samples_to_pixels(model, trajectory.final)
    scored = score(pixels, prompts)
    rewards = torch.tensor(scored if scored is not None else [0.0] * len(prompts))
    advantages = flow_advantages(rewards, s.group_size, s).to(trajectory.final.device)
    with cpu_threads(s.train_threads):
        losses, clip_fraction = train_on_batch(
            model, optimizer, FlowBatch(prompts, x0, text, mask, trajectory, advantages), s,
            generator, iteration=iteration, reference=reference, old=old, scheduler=scheduler,
        )  # fmt: skip
    record = {
        "iteration": float(iteration),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "rewards_lost": float(scored is None),
        "loss": sum(losses) / len(losses),
        "clip_fraction": clip_fraction,
    }
    distance = data_distance(pixels, prompts, clips)
    if distance is not None:  # (a prompt dataset has no data to be near)
        record["data_distance"] = distance
    return record


def rollout_velocity(
    model: nn.Module, text: Tensor, mask: Tensor, s: FlowRLSettings, *, given: Tensor | None
) -> Callable[[Tensor, Tensor], Tensor]:
    # (a conditioning run passes the mask even where nothing is given: every rank's model
    # then uses the same parameters, as FSDP2's gradient reduction needs)
    condition = None if given is None else given.float()
    scale = s.guidance_scale
    if isinstance(model, DiffusersFlowModel):  # (Cosmos-Predict2.5 counts it from 0)
        scale = model.guidance_scale(scale)
    null_text = null_mask = None
    encoder = flow_text_encoder(model)
    if encoder is not None and scale != 1.0:  # (the pipeline's default negative prompt)
        null_text, null_mask = (
            t.to(text.device).expand(len(text), -1, *t.shape[2:])
            for t in clip_text([Clip("null", encoder.negative_prompt, None, None)], encoder)
        )

    def velocity(x: Tensor, sigma: Tensor) -> Tensor:
        return guided_velocity(
            model, x, sigma, text, mask, guidance_scale=scale, condition=condition,
            null_text=null_text, null_mask=null_mask,
            detach_unconditional=s.detach_unconditional,
        )  # fmt: skip

    return velocity


def _given(trajectory: Trajectory, part: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The conditioning frames of the samples `part` ([n, T] bool; None in a run without them)
    and their `free` weights (:func:`~nebula_rl.flow.sampler.context_frames`; None when none is
    given)."""
    if trajectory.given is None:
        return None, None
    given = trajectory.given[part]
    return given, context_frames(given)


def _reference_due(s: FlowRLSettings, iteration: int) -> bool:
    """Whether the KL reference takes the current weights before `iteration` trains: after
    every `reference_reset_interval` iterations."""
    every = s.reference_reset_interval
    return every > 0 and iteration > 1 and (iteration - 1) % every == 0


def _trained_steps(s: FlowRLSettings, generator: torch.Generator) -> list[int]:
    """The steps of each trajectory trained this iteration: `train_on`'s (its -1s drawn from
    `generator` among the others), else the first `timestep_fraction` of them."""
    if s.train_on is None:
        return list(range(max(1, int(s.sample_steps * s.timestep_fraction))))
    named = [i for i in s.train_on if i >= 0]
    rest = [i for i in range(s.sample_steps) if i not in named]
    drawn = torch.randperm(len(rest), generator=generator)[: len(s.train_on) - len(named)]
    return sorted(named + [rest[int(k)] for k in drawn])


def _update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    s: FlowRLSettings,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    sync_grads: Callable[[], None] | None,
) -> None:
    """One optimiser update from the gradients accumulated: summed with the other processes'
    (`sync_grads`), clipped to `grad_clip` (0: not clipped, as for language models), stepped,
    and the schedule advanced."""
    if sync_grads is not None:
        sync_grads()
    if s.grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


def _log_ratio_scale(
    s: FlowRLSettings, scale: float, free: Tensor | None, like: Tensor
) -> Tensor | float:
    """The factor on a step's log-probability difference: 1 for the Gaussians' ratio; for
    cosmos-rl's squared errors `2 scale^2` (undoing the log-density's 1 / (2 scale^2)) times the
    generated share of the elements (its mean runs over all of them, the given ones 0)."""
    if s.ratio_form == "gaussian":
        return 1.0
    return 2 * scale**2 * free_fraction(free, like)


def _train_flow_grpo(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: FlowBatch,
    s: FlowRLSettings,
    generator: torch.Generator,
    reference: nn.Module | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    sync_grads: Callable[[], None] | None,
) -> tuple[list[float], float]:
    """FlowGRPO (DDRL with `data_beta`): replay the trajectories' first steps in minibatches;
    (each minibatch's loss, the fraction of clipped ratios)."""
    high = s.clip_range if s.clip_range_high is None else s.clip_range_high
    trajectory, steps = batch.trajectory, _trained_steps(s, generator)
    trained = len(steps)
    order = torch.randperm(len(batch.prompts), generator=generator)
    losses, clipped, seen = [], 0, 0
    for part in torch.tensor_split(order, s.num_minibatches):
        optimizer.zero_grad()
        given, free = _given(trajectory, part)
        velocity = rollout_velocity(model, batch.text[part], batch.mask[part], s, given=given)
        total = 0.0
        for j in steps:
            x = trajectory.latents[part, j]
            sigma = torch.full((len(part),), float(trajectory.sigmas[j]), device=x.device)
            step = sde_step(
                x, velocity(x, sigma), trajectory.sigmas, j, noise_level=s.noise_level,
                sample=trajectory.latents[part, j + 1], free=free,
            )  # fmt: skip
            assert step.log_prob is not None
            before = trajectory.log_probs[part, j]
            scale = _log_ratio_scale(s, step.scale, free, x)
            policy = flow_grpo_loss(
                step.log_prob, before, batch.advantages[part], clip_range=s.clip_range,
                clip_range_high=high, log_ratio_scale=scale,
            )  # fmt: skip
            ratio = torch.exp((step.log_prob.detach() - before) * scale)
            clipped += int(((ratio < 1 - s.clip_range) | (ratio > 1 + high)).sum())
            kl = None
            if reference is not None:
                with torch.no_grad():
                    v_ref = rollout_velocity(
                        reference, batch.text[part], batch.mask[part], s, given=given
                    )(x, sigma)
                    ref_mean = sde_step(
                        x, v_ref, trajectory.sigmas, j, noise_level=s.noise_level,
                        sample=trajectory.latents[part, j + 1],
                    ).mean  # fmt: skip
                kl = flow_grpo_kl(step.mean, ref_mean, step.std, free=free, form=s.kl_form)
            seen += len(part)
            data = torch.zeros((), device=x.device)
            if s.data_beta > 0:
                assert batch.x0 is not None
                start = trajectory.latents[part, 0]  # the rollout's own noise
                sg = sigma.view(-1, *[1] * (x.dim() - 1))
                noised = keep_given((1 - sg) * batch.x0[part] + sg * start, batch.x0[part], free)
                extra = () if given is None else (given.float(),)
                v_data = model(noised, sigma, batch.text[part], batch.mask[part], *extra)
                data = flow_matching_loss(
                    v_data, batch.x0[part], start, sigma, weighting="edm", free=free
                )
            loss = ddrl_loss(policy, data, data_beta=s.data_beta, kl=kl, kl_beta=s.kl_beta)
            (loss / trained).backward()
            total += loss.item() / trained
        _update(model, optimizer, s, scheduler, sync_grads)
        losses.append(total)
    return losses, clipped / max(seen, 1)


def _train_nft(
    model: nn.Module,
    old: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: FlowBatch,
    s: FlowRLSettings,
    generator: torch.Generator,
    iteration: int,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    sync_grads: Callable[[], None] | None,
) -> tuple[list[float], float]:
    """DiffusionNFT: the generated samples noised afresh at the rollout's noise levels, scored
    against the implicit policies around the old weights, which follow softly after each
    optimiser step (once the iteration's are done, with `nft_old_update = "iteration"`); (each
    minibatch's loss, 0: no ratio is clipped)."""
    x0 = batch.trajectory.final
    sigmas = batch.trajectory.sigmas
    steps = _trained_steps(s, generator)
    trained = len(steps)
    order = torch.randperm(len(batch.prompts), generator=generator)
    losses = []
    for part in torch.tensor_split(order, s.num_minibatches):
        optimizer.zero_grad()
        given, free = _given(batch.trajectory, part)
        extra = () if given is None else (given.float(),)
        total = 0.0
        for j in steps:
            t = torch.full((len(part),), float(sigmas[j]), device=x0.device)
            noise = _nft_noise(batch, part, j, generator).to(x0.device)
            tb = t.view(-1, *[1] * (x0.dim() - 1))
            x_t = keep_given((1 - tb) * x0[part] + tb * noise, x0[part], free)
            text, mask = batch.text[part], batch.mask[part]
            with torch.no_grad():
                v_old = old(x_t, t, text, mask, *extra)
            loss = nft_loss(
                model(x_t, t, text, mask, *extra), v_old, x_t, x0[part], t,
                batch.advantages[part], beta=s.nft_beta, adv_clip=s.adv_clip, free=free,
            ) / trained  # fmt: skip
            loss.backward()
            total += loss.item()
        _update(model, optimizer, s, scheduler, sync_grads)
        if s.nft_old_update == "minibatch":
            soft_update(old, model, decay=nft_old_decay(iteration, s.nft_decay_type))
        losses.append(total)
    if s.nft_old_update == "iteration":
        soft_update(old, model, decay=nft_old_decay(iteration, s.nft_decay_type))
    return losses, 0.0
