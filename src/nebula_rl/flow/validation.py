"""World-model validation (`[validation]` of a `policy.is_diffusers` run): held-out clips,
sampled or noised with draws fixed per sample, reported in the record of the validated step.

When: as for language models (`nebula_rl.utils.validation.validation_due`): the initial weights with
`val_before_train`, every `validation.freq` steps, and after the last step. With
`train.ema_enable` the weights' averages are validated (cosmos-rl's rule).

On what: the clips of `validation.dataset` (a folder in cosmos-rl's local layout, or
`builtin:toy_video` with `validation.dataset.kwargs`, written beside the training one from
another seed: other clips of the same captions), the first `validation.max_num_prompts`
(`flow.job.flow_clips`).

- RL: `validation.n_generation` deterministic samples of each clip's caption (the ODE in
  `policy.diffusers.sample.eval_num_steps` steps, with the rollouts' guidance, shift, solver and
  conditioning frames), `validation.batch_size` clips per sampler call (default
  `rollout.batch_size`), scored by `validation.reward_function` (empty: the training rewards).
  The record gets :data:`FLOW_VALIDATION_KEYS`: the rewards' mean, std, max and min, their
  count, the validated policy version, and `val/data_distance`, the samples' mean distance to
  the validation clips of their caption (`flow.local.data_distance`).
- SFT: `val_loss` (a language model's SFT key), the mean over the clips of the flow-matching
  loss, `validation.batch_size` clips per forward (default `train.train_policy.mini_batch`).
- SFT on a prompt dataset (cosmos-rl's diffusers validation file: captions only, no loss to
  take): `validation.n_generation` deterministic samples of each caption, the ODE in
  `policy.diffusers.sample.num_steps` steps with `sample.guidance_scale` (as cosmos-rl's SFT
  validation samples; it fixes the guidance at 4.5 whatever the config says), written to
  `<run>/visual_output/<step>/` (a PNG an image, an MP4 a video, `.npy` frames without PyAV)
  with a grid of them for the dashboards; `val/rollout_count` counts them, and a
  `validation.reward_function` scores them (`val/reward_*`).

Each sample's draws (noise, SFT's noise level, the count of conditioning frames) come from a
seed of its own that is the same at every validation, so a validation curve moves with the
weights only. On a sharded model (SFT on several ranks, colocated RL) the clips are split over
the data-parallel ranks, each running as many forwards (a short share repeats its last clip and
drops the repeat), and the results are gathered; in the runtime the controller hands the clips
out as validation prompts, which rollout replicas sample (`flow.runtime`).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from nebula_rl.algorithms.flow import flow_matching_loss
from nebula_rl.config import Config
from nebula_rl.flow.data import Clip, clip_pixels, clip_text, save_samples, write_mp4
from nebula_rl.flow.local import (
    FlowRLSettings,
    RewardFn,
    data_distance,
    given_frames,
    rollout_velocity,
    sft_sigmas,
)
from nebula_rl.flow.parallel import sum_over
from nebula_rl.flow.sampler import context_frames, keep_given, sample
from nebula_rl.flow.text_encoder import flow_text_encoder
from nebula_rl.flow.vae import pixels_to_samples, sample_shape, samples_to_pixels
from nebula_rl.rewards.visual import pixels_from_samples
from nebula_rl.utils.validation import validation_metrics, validation_seed

__all__ = [
    "FLOW_VALIDATION_KEYS",
    "sample_seeds",
    "scored_clips",
    "validate_generation",
    "validate_loss",
    "validate_samples",
    "validation_loss",
    "validation_samples",
]

FLOW_VALIDATION_KEYS = (
    "val/reward_mean",
    "val/reward_std",
    "val/reward_max",
    "val/reward_min",
    "val/rollout_count",
    "val/policy_version",
    "val/data_distance",
)
"""The metrics a world model's RL validation adds to its step's record."""


def _drawn(
    model: nn.Module, real: list[Clip], seeds: Sequence[int], conditional_frames: tuple[int, int]
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, list[torch.Generator], Tensor | None]:
    """`real`'s pixels (None for prompts without clips), text and mask, with noise and given
    frames drawn per sample from its own seed, so that a sample's draws do not depend on its
    batch: (pixels, text, mask, noise, a generator per sample, given)."""
    device = next(model.parameters()).device
    text, mask = (t.to(device) for t in clip_text(real, flow_text_encoder(model)))
    pixels = None
    if all(c.video is not None for c in real):
        pixels = clip_pixels(real).to(device)
    shape = sample_shape(model, real[0].shape)
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    noise = torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)
    drawn = [given_frames(shape[1], 1, conditional_frames, g, device) for g in generators]
    given = None if drawn[0] is None else torch.cat(drawn)  # type: ignore[arg-type]
    return pixels, text, mask, noise, generators, given


def validation_samples(
    model: nn.Module, real: list[Clip], seeds: Sequence[int], s: FlowRLSettings, *, num_steps: int
) -> Tensor:
    """Deterministic samples of `real`'s captions (one per entry) as pixels [B, 3, T, H, W] in
    [-1, 1]: the ODE in `num_steps` steps with the rollouts' guidance, shift and solver, from
    noise (and given frames, with `conditional_frames`) drawn from each sample's seed."""
    pixels, text, mask, noise, _, given = _drawn(model, real, seeds, s.conditional_frames)
    training = model.training
    model.eval()
    with torch.no_grad():
        clean = None if given is None else pixels_to_samples(model, _data(pixels, real))
        final = sample(
            rollout_velocity(model, text, mask, s, given=given), noise, num_steps=num_steps,
            noise_level=0.0, shift=s.shift, solver=s.solver, given=given, clean=clean,
        ).final  # fmt: skip
        pixels = samples_to_pixels(model, final)
    model.train(training)
    return pixels


def validation_loss(
    model: nn.Module,
    clips: list[Clip],
    seeds: Sequence[int],
    *,
    sigma_scheme: str = "uniform",
    sigma_mean: float = 0.0,
    sigma_std: float = 1.0,
    conditional_frames: tuple[int, int] = (0, 0),
) -> list[float]:
    """The flow-matching loss of :func:`pretrain` of each of `clips`, without gradients: each
    clip's noise level, noise and given frames drawn from its seed in `seeds`."""
    pixels, text, mask, noise, generators, given = _drawn(model, clips, seeds, conditional_frames)
    with torch.no_grad():
        x0 = pixels_to_samples(model, _data(pixels, clips))
    sigma = torch.cat(
        [sft_sigmas(1, g, scheme=sigma_scheme, mean=sigma_mean, std=sigma_std) for g in generators]
    ).to(x0.device)
    s = sigma.view(-1, *[1] * (x0.dim() - 1))
    free = context_frames(given)
    noised = (1 - s) * x0 + s * noise
    extra: tuple[Tensor, ...] = ()
    if given is not None:
        noised = keep_given(noised, x0, free)
        extra = (given.float(),)
    training = model.training
    model.eval()
    with torch.no_grad():
        velocity = model(noised, sigma, text, mask, *extra)
    model.train(training)
    return [
        float(flow_matching_loss(velocity[k : k + 1], x0[k : k + 1], noise[k : k + 1],
            sigma[k : k + 1], free=None if free is None else free[k : k + 1]))
        for k in range(len(clips))
    ]  # fmt: skip


def _data(pixels: Tensor | None, clips: list[Clip]) -> Tensor:
    """`pixels`, which only clips (not prompts alone) have."""
    if pixels is None:
        raise ValueError(
            f"{clips[0].stem}: a prompt dataset has no clips for this (SFT, DDRL's data term, "
            "conditioning frames)"
        )
    return pixels


def sample_seeds(cfg: Config, index: int, n: int) -> list[int]:
    """The seeds of the `n` samples of validation clip `index`: the same at every validation."""
    base = validation_seed(cfg, 0, index)
    return [base + j for j in range(n)]


def _share(count: int, dp: DeviceMesh | None) -> tuple[list[int], int]:
    """This rank's part of `count` clips split over `dp`'s ranks: (its indices, as many on every
    rank, a short share padded with its last clip; how many of them are its own)."""
    if dp is None:
        return list(range(count)), count
    rank, world = dp.get_local_rank(), dp.size()
    per = -(-count // world)
    mine = list(range(rank * per, min((rank + 1) * per, count)))
    return mine + (mine[-1:] or [0]) * (per - len(mine)), len(mine)


def _gathered(results: list[Any], dp: DeviceMesh | None) -> list[Any]:
    """Every data-parallel rank's `results`, in rank order."""
    if dp is None:
        return results
    parts: list[Any] = [None] * dp.size()
    dist.all_gather_object(parts, results, group=dp.get_group())
    return [r for part in parts for r in part]


def scored_clips(
    model: nn.Module,
    clips: list[Clip],
    indices: list[int],
    s: FlowRLSettings,
    cfg: Config,
    score: RewardFn,
) -> list[tuple[list[float] | None, list[float]]]:
    """Sample and score the validation clips `indices` of `clips` (see the module docstring):
    per clip, its samples' rewards (None when they were lost) and distances to the data."""
    n = cfg.validation.n_generation
    size = cfg.validation.batch_size or cfg.rollout.batch_size
    steps = cfg.policy.diffusers.sample.eval_num_steps
    out: list[tuple[list[float] | None, list[float]]] = []
    for chunk, pixels, captions in _sampled(model, clips, indices, s, cfg, steps=steps, size=size):
        scored = score(pixels, captions)
        for k in range(len(chunk)):
            rows = range(k * n, (k + 1) * n)
            found = [data_distance(pixels[j : j + 1], captions[j : j + 1], clips) for j in rows]
            distances = [d for d in found if d is not None]  # (none for a prompt dataset)
            out.append((None if scored is None else list(scored[k * n : (k + 1) * n]), distances))
    return out


def _sampled(
    model: nn.Module,
    clips: list[Clip],
    indices: list[int],
    s: FlowRLSettings,
    cfg: Config,
    *,
    steps: int,
    size: int,
) -> Iterator[tuple[list[int], Tensor, list[str]]]:
    """The validation samples of the clips `indices` of `clips`, `size` clips at a time: per
    chunk, (its clip indices, `validation.n_generation` deterministic samples of each as pixels
    [len(chunk) * n, 3, T, H, W] in [-1, 1] on the CPU, their captions); the ODE in `steps`
    steps with `s`'s guidance, shift, solver and conditioning frames."""
    n = cfg.validation.n_generation
    for start in range(0, len(indices), size):
        chunk = indices[start : start + size]
        real = [clips[i] for i in chunk for _ in range(n)]
        seeds = [seed for i in chunk for seed in sample_seeds(cfg, i, n)]
        pixels = validation_samples(model, real, seeds, s, num_steps=steps).float().cpu()
        yield chunk, pixels, [c.caption for c in real]


def validate_generation(
    model: nn.Module,
    clips: list[Clip],
    s: FlowRLSettings,
    cfg: Config,
    score: RewardFn,
    *,
    step: int,
    dp: DeviceMesh | None = None,
) -> dict[str, float]:
    """RL validation of `model`'s weights after step `step` on `clips`: the `val/*` metrics
    (every data-parallel rank of a sharded `model` calls it, and gets them)."""
    indices, own = _share(len(clips), dp)
    results = _gathered(scored_clips(model, clips, indices, s, cfg, score)[:own], dp)
    rewards = [r for scored, _ in results if scored is not None for r in scored]
    distances = [d for _, ds in results for d in ds]
    return validation_metrics(rewards, None, [step] * len(rewards), distances=distances)


def validate_loss(
    model: nn.Module, clips: list[Clip], cfg: Config, *, dp: DeviceMesh | None = None
) -> dict[str, float]:
    """SFT validation of `model`'s weights on `clips`: `val_loss` (every data-parallel rank of
    a sharded `model` calls it, and gets it)."""
    d = cfg.policy.diffusers
    size = cfg.validation.batch_size or cfg.train.train_policy.mini_batch
    indices, own = _share(len(clips), dp)
    losses: list[float] = []
    for start in range(0, len(indices), size):
        chunk = indices[start : start + size]
        losses += validation_loss(
            model, [clips[i] for i in chunk], [sample_seeds(cfg, i, 1)[0] for i in chunk],
            sigma_scheme=d.weighting_scheme, sigma_mean=d.logit_mean, sigma_std=d.logit_std,
            conditional_frames=(d.min_num_conditional_frames, d.max_num_conditional_frames),
        )  # fmt: skip
    total = torch.tensor([sum(losses[:own])], dtype=torch.float64)
    if dp is not None:
        sum_over(total, dp)
    return {"val_loss": float(total) / len(clips)}


def validate_samples(
    model: nn.Module,
    clips: list[Clip],
    cfg: Config,
    *,
    step: int,
    run_dir: Path,
    score: RewardFn | None = None,
    dp: DeviceMesh | None = None,
    write: bool = True,
) -> tuple[dict[str, float], Path | None]:
    """SFT validation of `model`'s weights on a prompt dataset `clips` (see the module
    docstring), on every data-parallel rank of a sharded `model`: (the `val/*` metrics; the
    grid's path where this rank `write`s the samples, the job's lead rank, else None)."""
    v, d = cfg.validation, cfg.policy.diffusers
    s = FlowRLSettings(
        guidance_scale=d.sample.guidance_scale, shift=d.train_flow_shift, solver=d.sample.solver
    )
    n, size = v.n_generation, v.batch_size or cfg.train.train_policy.mini_batch
    indices, own = _share(len(clips), dp)
    # (per clip: its index, its samples as uint8 [n, 3, T, H, W], their rewards or None)
    samples: list[tuple[int, Tensor, list[float] | None]] = []
    chunks = _sampled(model, clips, indices, s, cfg, steps=d.sample.num_steps, size=size)
    for chunk, pixels, captions in chunks:
        scored = None if score is None else score(pixels, captions)
        uint8 = pixels_from_samples(pixels)
        samples += [
            (
                i,
                uint8[k * n : (k + 1) * n],
                None if scored is None else list(scored[k * n : (k + 1) * n]),
            )
            for k, i in enumerate(chunk)
        ]
    gathered = _gathered(samples[:own], dp)
    count = sum(len(part) for _, part, _ in gathered)
    rewards = [r for _, _, scored in gathered if scored is not None for r in scored]
    metrics: dict[str, float] = {"val/rollout_count": count}
    if rewards:
        metrics = validation_metrics(rewards, None, [step] * len(rewards))
    if not write:
        return metrics, None
    written = [(i, part) for i, part, _ in gathered]
    return metrics, _write_samples(written, clips, run_dir / "visual_output" / str(step))


def _write_samples(samples: list[tuple[int, Tensor]], clips: list[Clip], folder: Path) -> Path:
    """Each sample as `<clip>_<sample>_<caption>.png` (a frame) or `.mp4` (frames; `.npy`
    without PyAV) in `folder`,
    and their grid (a row per caption, at most 8; samples and frames side by side) as
    `grid.png`, for videos also animated as `grid.gif`; the PNG grid's path."""
    folder.mkdir(parents=True, exist_ok=True)
    mp4 = importlib.util.find_spec("av") is not None  # (without PyAV: `.npy` frames)
    for i, part in samples:
        slug = re.sub(r"[^A-Za-z0-9]+", "_", clips[i].caption).strip("_")[:40]
        for j, clip in enumerate(part):
            frames = clip.permute(1, 2, 3, 0).numpy()  # [T, H, W, 3]
            stem = folder / f"{i:04d}_{j}_{slug}"
            if len(frames) == 1:
                Image.fromarray(frames[0]).save(stem.with_suffix(".png"))
            elif mp4:
                write_mp4(stem.with_suffix(".mp4"), frames)
            else:
                np.save(stem.with_suffix(".npy"), frames)
    return save_samples(torch.stack([part for _, part in samples[:8]]), folder / "grid.png")
