"""A world-model run from its config (`policy.is_diffusers = true`) in this job:
`nebula-rl train --config X` for SFT (`trainer_type = "diffusers_sft"`), with `--local` or
`mode = "colocated"` for RL (`"flow_grpo"`, `"ddrl"`, `"diffusion_nft"`). One process, or
`policy.parallelism.dp_shard_size` ranks over which the model is FSDP2-sharded (or
`dp_replicate_size` x `dp_shard_size` ranks, HSDP) (SFT, and colocated RL:
`nebula_rl.flow.colocated`).

How the config's keys map onto the loop of `nebula_rl.flow.local`:

- rows are the dataset's clips (`dataset.name`: a folder in cosmos-rl's local layout, or
  `builtin:toy_video` with `dataset.kwargs` for :func:`make_toy_dataset`, written into the run
  folder); an RL iteration takes `train_batch_per_replica / rollout.n_generation` clips, in a
  seeded order per epoch, and samples each clip's caption `n_generation` times; `train.epoch`
  and `train.max_num_steps` bound the iterations (SFT: steps of `train_batch_per_replica`
  clips), as for language models;
- `train_batch_per_replica / mini_batch` optimiser steps per iteration; the optimiser and its
  schedule are `train.optm_*`'s, as for language models;
- `epsilon_low` / `epsilon_high` clip the ratio (FlowGRPO's reference value is 1e-4),
  `kl_beta` weighs the KL to the starting weights, `data_beta` and `exp_reward` are DDRL's;
- `policy.diffusers`: the frame size and count, `timesteps_fraction` (steps trained),
  `train_flow_shift` (the rollout schedule's shift), `nft_beta`, the SFT noise levels
  (`weighting_scheme`, `logit_mean`, `logit_std`), `max_prompt_length` (text tokens kept) and
  `sample.*` (rollout steps, noise level, guidance, batch-wide std, deterministic sampling for
  DiffusionNFT; `eval_num_steps` for the sample grids and validation);
- rewards: `reward_function` names of `nebula_rl.rewards.visual` with weights, or with
  `use_remote_reward` the reward service (`remote_reward.reward_fns`: name, weight, score_key,
  clip; `scale`, the total's clip, `batch_size` samples per request), reached through
  `REMOTE_REWARD_*` environment variables. Both score pixels: a latent-space model's samples
  are decoded by its own VAE first, and the service gets uint8 clips (`media_type = "video"`,
  [B, 3, T, H, W]), never latents (nebula-rl's service runs no VAE, and cosmos-rl's decodes
  only Wan latents, with its own checkpoint);
- `policy.diffusers.tokenizer.compile_encode` compiles a latent-space model's VAE encoder
  (`nebula_rl.flow.vae`); the tokenizer's other keys are refused.
- `[validation]`: held-out clips sampled and scored (RL) or noised (SFT) at the due steps
  (`nebula_rl.flow.validation`).

The run folder gets `metrics.jsonl`, `logs/`, the export `safetensors/final` (loadable as
`policy.model_name_or_path`) and `samples.png`. `[logging] logger` sinks get every record, and
with `logging.multi_modal_log_interval` a sample grid every that many steps (TensorBoard's
images, W&B images, `samples/step_<N>.png`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from PIL import Image
from torch import Tensor

from nebula_rl.config import FLOW_RL_TRAINERS, Config, GrpoConfig
from nebula_rl.config.base import reward_weights
from nebula_rl.data import epoch_order, num_train_steps
from nebula_rl.flow.clips import dataset_entries
from nebula_rl.flow.colocated import run_colocated
from nebula_rl.flow.data import (
    Clip,
    clip_text,
    frame_grid,
    prompt_clips,
    read_caption_entries,
    read_local_entries,
    save_samples,
)
from nebula_rl.flow.ema import FlowTrainingState, WeightEMA
from nebula_rl.flow.local import FlowRLSettings, RewardFn, pretrain, run_flow_rl
from nebula_rl.flow.models import load_flow_model
from nebula_rl.flow.parallel import (
    checkpoint_blocks,
    dp_mesh,
    frozen_copy,
    save_sharded_flow_model,
    shard_flow_model,
    sum_over,
)
from nebula_rl.flow.sampler import guided_velocity, sample
from nebula_rl.flow.text_encoder import flow_text_encoder
from nebula_rl.flow.vae import sample_shape, samples_to_pixels
from nebula_rl.flow.validation import validate_generation, validate_loss, validate_samples
from nebula_rl.policy.checkpoint import Checkpointer, resume_checkpoint
from nebula_rl.policy.optim import build_optimizer, lr_lambda
from nebula_rl.rewards.visual import VISUAL_REWARDS, pixels_from_samples
from nebula_rl.runs import resolve_run_dir
from nebula_rl.utils.metrics_log import log_image_file, open_loggers
from nebula_rl.utils.ranks import close_ranks, init_ranks, rank_env
from nebula_rl.validation import validation_due

__all__ = [
    "check_ranks",
    "flow_clips",
    "flow_optimizer",
    "flow_scorer",
    "flow_settings",
    "flow_validation_scorer",
    "run",
    "sample_grid",
    "sample_pixels",
    "step_samples",
    "visual_scorer",
    "weight_ema",
]

log = logging.getLogger(__name__)


def flow_clips(
    cfg: Config, run_dir: Path, *, create: bool = True, validation: bool = False
) -> list[Clip]:
    """The clips of `cfg`'s dataset (with `validation`, of `validation.dataset`, its first
    `validation.max_num_prompts`), read into tensors, in the order of the controller's rows
    (:func:`~nebula_rl.flow.clips.dataset_entries`, which writes a toy dataset when `create`)."""
    d = cfg.policy.diffusers
    frames = d.inference_frames if d.is_video else 1
    height, width = d.inference_size
    listed = dataset_entries(cfg, run_dir, create=create, validation=validation)
    if listed.layout == "captions":  # (cosmos-rl's diffusers folder: captions, no embeddings)
        clips = read_caption_entries(
            listed.entries, num_frames=frames, height=height, width=width, key=listed.key
        )
    elif listed.layout == "prompts":  # (captions only: the model's text encoder embeds them)
        clips = prompt_clips(listed.entries, shape=(3, frames, height, width))
    else:
        clips = read_local_entries(listed.entries, num_frames=frames, key=listed.key)
    keep = d.max_prompt_length
    return [dataclasses.replace(c, text=None if c.text is None else c.text[:keep]) for c in clips]


def _ordered(cfg: Config, clips: list[Clip], per_step: int) -> Any:
    """`batch(step)`: the clips of step `step` (1-based), epochs in seeded shuffled orders."""
    per_epoch = len(clips) // per_step
    seed = cfg.train.seed or 0

    def batch(step: int) -> list[Clip]:
        epoch, index = divmod(step - 1, per_epoch)
        order = epoch_order(len(clips), epoch=epoch, shuffle=True, seed=seed)
        return [clips[i] for i in order[index * per_step : (index + 1) * per_step]]

    return batch


def _local_rewards(weights: dict[str, float], key: str) -> RewardFn:
    unknown = sorted(set(weights) - set(VISUAL_REWARDS))
    if unknown:
        raise ValueError(
            f"{key}: {unknown} are not rewards of images or videos; choose from "
            f"{sorted(VISUAL_REWARDS)} (or use_remote_reward)"
        )
    return visual_scorer(weights)


def visual_scorer(weights: dict[str, float]) -> RewardFn:
    """Score samples in this process: the weighted sum of the named rewards of
    `nebula_rl.rewards.visual` on their pixels."""

    def score(samples: Tensor, prompts: Sequence[str]) -> list[float]:
        pixels = pixels_from_samples(samples)
        total = [0.0] * len(prompts)
        for name, weight in weights.items():
            for i, value in enumerate(VISUAL_REWARDS[name](pixels, prompts)):
                total[i] += weight * value
        return total

    return score


def _remote_rewards(p: GrpoConfig) -> RewardFn:
    from nebula_rl.rewards.remote import RemoteRewardClient

    r = p.remote_reward
    client = RemoteRewardClient.from_env()
    names = {f.name: f for f in r.reward_fns}
    asked = dict.fromkeys(names, 1.0)
    keys = {f.name: f.score_key or f.name for f in r.reward_fns}

    def score(samples: Tensor, prompts: Sequence[str]) -> list[float] | None:
        pixels = pixels_from_samples(samples)  # (uint8: what a clip is to the service)
        total: list[float] = []
        for start in range(0, len(prompts), r.batch_size):
            part = slice(start, start + r.batch_size)
            uuid = client.enqueue(pixels[part], list(prompts[part]), asked, media_type="video")
            scores = client.pull(uuid, list(names), score_keys=keys)
            if scores is None:
                return None
            for i in range(len(prompts[part])):
                value = 0.0
                for name, f in names.items():
                    value += f.weight * min(max(scores[name][i], f.clip_min), f.clip_max)
                total.append(min(max(r.scale * value, r.reward_clip_min), r.reward_clip_max))
        return total

    return score


def weight_ema(
    cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> WeightEMA | None:
    """With `train.ema_enable`, the averages of `model`'s weights, moved after each step of
    `optimizer`."""
    t = cfg.train
    if not t.ema_enable:
        return None
    ema = WeightEMA(model, decay=t.ema_decay, interval=t.ema_update_step_interval)
    optimizer.register_step_post_hook(lambda *_: ema.step())
    return ema


def flow_scorer(p: GrpoConfig) -> RewardFn:
    """The rewards of `p`: the reward service with `use_remote_reward`, else computed here."""
    if p.use_remote_reward:
        return _remote_rewards(p)
    return _local_rewards(reward_weights(p.reward_function), "train.train_policy.reward_function")


def flow_validation_scorer(cfg: Config, training: RewardFn | None) -> RewardFn | None:
    """The rewards of validation: `validation.reward_function`'s, computed here, else the
    training ones (`training`; SFT's: None)."""
    weights = reward_weights(cfg.validation.reward_function)
    return _local_rewards(weights, "validation.reward_function") if weights else training


def flow_settings(cfg: Config, *, num_iterations: int, prompts: int) -> FlowRLSettings:
    """The loop's settings for `cfg` (see the module docstring), `prompts` captions per
    iteration (per policy replica)."""
    p, d = cfg.train.train_policy, cfg.policy.diffusers
    assert isinstance(p, GrpoConfig)
    n = cfg.rollout.n_generation
    batch = prompts * n
    if batch % p.mini_batch:
        raise ValueError(
            f"train.train_policy.mini_batch ({p.mini_batch}) must divide the samples of a step "
            f"({prompts} prompts x rollout.n_generation {n})"
        )
    return FlowRLSettings(
        algorithm=FLOW_RL_TRAINERS[p.trainer_type],  # type: ignore[arg-type]
        num_iterations=num_iterations,
        prompts_per_iteration=prompts,
        group_size=n,
        sample_steps=d.sample.num_steps,
        noise_level=0.0 if d.sample.deterministic_sampling else d.sample.noise_level,
        timestep_fraction=d.timesteps_fraction,
        train_on=None if d.train_on is None else tuple(d.train_on),
        same_group_noise=d.sample.same_group_noise,
        reference_reset_interval=max(p.reference_reset_interval or 0, 0),
        reset_optimizer_with_reference=p.reset_optimizer_with_reference,
        num_minibatches=batch // p.mini_batch,
        clip_range=p.epsilon_low,
        clip_range_high=p.epsilon_high,
        kl_beta=p.kl_beta,
        ratio_form=d.ratio_form,
        kl_form=d.kl_form,
        global_std=d.sample.global_std,
        population_std=d.sample.population_std,
        detach_unconditional=d.detach_unconditional,
        shift=d.train_flow_shift,
        grad_clip=cfg.train.optm_grad_norm_clip,
        data_beta=p.data_beta,
        exp_reward=p.exp_reward,
        nft_beta=d.nft_beta,
        nft_decay_type=d.weight_copy_decay_type,
        nft_old_update=d.nft_old_update,
        guidance_scale=d.sample.guidance_scale,
        solver=d.sample.solver,
        conditional_frames=(d.min_num_conditional_frames, d.max_num_conditional_frames),
        seed=cfg.train.seed or 0,
        rollout_threads=cfg.rollout.cpu_threads,
        train_threads=cfg.policy.cpu_threads,
    )


def flow_optimizer(cfg: Config, model: torch.nn.Module, total_steps: int) -> tuple[Any, Any]:
    optimizer = build_optimizer(model, cfg.train)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.train, total_steps)
    )


def sample_grid(
    model: torch.nn.Module, clips: list[Clip], *, num_steps: int, shift: float = 1.0, seed: int = 0
) -> Image.Image:
    """:func:`sample_pixels` as one image, frames side by side."""
    return frame_grid(sample_pixels(model, clips, num_steps=num_steps, shift=shift, seed=seed))


def sample_pixels(
    model: torch.nn.Module, clips: list[Clip], *, num_steps: int, shift: float = 1.0, seed: int = 0
) -> Tensor:
    """uint8 samples [rows, 4, 3, T, H, W]: one row per caption (at most 8, sorted), four
    samples each (the Euler ODE in `num_steps` steps with the schedule's `shift`, noise drawn
    from `seed`; a latent-space model's decoded)."""
    captions = sorted({c.caption for c in clips})[:8]
    chosen = [next(c for c in clips if c.caption == caption) for caption in captions]
    device = next(model.parameters()).device
    repeated = [c for c in chosen for _ in range(4)]
    text, mask = (t.to(device) for t in clip_text(repeated, flow_text_encoder(model)))
    shape = sample_shape(model, chosen[0].shape)
    noise = torch.randn(len(text), *shape, generator=torch.Generator().manual_seed(seed))
    noise = noise.to(device)
    training = model.training
    model.eval()
    with torch.no_grad():
        final = sample(
            lambda x, s: guided_velocity(model, x, s, text, mask),
            noise,
            num_steps=num_steps,
            noise_level=0.0,
            shift=shift,
        ).final
        final = samples_to_pixels(model, final)
    model.train(training)
    pixels = pixels_from_samples(final.float().cpu())
    return pixels.view(len(captions), 4, *chosen[0].shape)


def step_samples(run_dir: Path, step: int) -> Path:
    """Where step `step`'s samples go: `<run>/samples/step_<N>.png` (`.gif` beside it)."""
    return run_dir / "samples" / f"step_{step}.png"


def check_ranks(cfg: Config) -> None:
    """Refuse a split of the model this kind of run does not make: world-model RL in this job
    (`--local`) is one process unless `mode = "colocated"`."""
    par = cfg.policy.parallelism
    split = [
        f"{k} = {v}"
        for k, v in (
            ("dp_shard_size", par.dp_shard_size),
            ("dp_replicate_size", par.dp_replicate_size),
            ("cp_size", par.cp_size),
        )
        if v != 1
    ]
    if split and isinstance(cfg.train.train_policy, GrpoConfig) and cfg.mode != "colocated":
        raise ValueError(
            f"policy.parallelism.{', '.join(split)}: `--local` world-model RL is one "
            'process; set mode = "colocated" to sample and train on the policy\'s ranks, or '
            "run without --local (policy and rollout replicas)"
        )


def run(cfg: Config) -> Path:
    """Run the world-model config `cfg` in this process (one of its ranks); its run folder."""
    p = cfg.train.train_policy
    check_ranks(cfg)
    ranks = rank_env()
    cuda = torch.cuda.is_available()
    if ranks.world_size > 1:
        init_ranks("nccl" if cuda else "gloo")
    lead = ranks.rank == 0
    device = torch.device("cuda", ranks.local_rank) if cuda else torch.device("cpu")
    run_dir = resolve_run_dir(cfg)
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    seed = cfg.train.seed or 0
    torch.manual_seed(seed)
    validating = cfg.validation.enable
    if lead:
        clips = flow_clips(cfg, run_dir, create=True)
        val_clips = flow_clips(cfg, run_dir, validation=True) if validating else []
    if ranks.world_size > 1:
        dist.barrier()  # (the toy datasets are written)
    if not lead:
        clips = flow_clips(cfg, run_dir, create=False)
        val_clips = flow_clips(cfg, run_dir, create=False, validation=True) if validating else []
    model = load_flow_model(cfg, seed=seed).to(device)
    if cfg.policy.model_gradient_checkpointing:
        checkpoint_blocks(model)
    par = cfg.policy.parallelism
    mesh = shard_flow_model(model, device, replicate=par.dp_replicate_size, cp=par.cp_size)
    dp = None if mesh is None else dp_mesh(mesh)
    rank, world = (0, 1) if dp is None else (dp.get_local_rank(), dp.size())
    d = cfg.policy.diffusers
    generator = torch.Generator().manual_seed(seed + 1000 * rank)  # (each rank its own noise)
    every = cfg.logging.multi_modal_log_interval

    def grid() -> Tensor:  # (every rank: the forward of a sharded model is collective)
        return sample_pixels(
            model, clips, num_steps=d.sample.eval_num_steps, shift=d.train_flow_shift
        )

    batch = cfg.train.train_batch_per_replica
    settings: FlowRLSettings | None = None
    old = reference = reset_reference = None
    if isinstance(p, GrpoConfig):
        n = cfg.rollout.n_generation
        if batch % n or batch % p.mini_batch:
            raise ValueError(
                f"train.train_batch_per_replica ({batch}) must be a multiple of "
                f"rollout.n_generation ({n}) and of train.train_policy.mini_batch "
                f"({p.mini_batch})"
            )
        prompts = batch // n
        if prompts % world:
            raise ValueError(
                f"policy.parallelism's data-parallel ranks ({world}: dp_shard_size * "
                f"dp_replicate_size) must divide the prompts of a step "
                f"(train_batch_per_replica / n_generation = {prompts})"
            )
        per_step = prompts
        steps = num_train_steps(cfg, len(clips), items_per_step=prompts)
        settings = flow_settings(cfg, num_iterations=steps, prompts=prompts // world)
        updates = steps * settings.num_minibatches
        # (the KL reference is the starting weights, copied before a checkpoint is loaded,
        # unless it is reset during the run: then the checkpoint restores it)
        old = frozen_copy(model, cfg, mesh=mesh) if settings.algorithm == "nft" else None
        reference = frozen_copy(model, cfg, mesh=mesh) if settings.kl_beta > 0 else None
        if settings.reference_reset_interval:  # (then checkpoints hold it)
            reset_reference = reference
    else:
        if batch % world:
            raise ValueError(
                f"policy.parallelism's data-parallel ranks ({world}: dp_shard_size * "
                f"dp_replicate_size) must divide train.train_batch_per_replica ({batch})"
            )
        per_step = batch
        steps = updates = num_train_steps(cfg, len(clips), items_per_step=batch)
    optimizer, scheduler = flow_optimizer(cfg, model, updates)
    ema = weight_ema(cfg, model, optimizer)
    score = flow_scorer(p) if isinstance(p, GrpoConfig) else None
    val_score = flow_validation_scorer(cfg, score) if validating else None
    val_prompts = bool(val_clips) and all(c.video is None for c in val_clips)

    def validate(step: int) -> dict[str, float]:  # (every rank: a sharded model's forwards)
        if not validation_due(cfg, step, total_steps=steps):
            return {}
        with ema.applied() if ema is not None else contextlib.nullcontext():
            if settings is None and val_prompts:  # (SFT on captions: samples to look at)
                metrics, grid = validate_samples(
                    model, val_clips, cfg, step=step, run_dir=run_dir, score=val_score, dp=dp,
                    write=lead,
                )  # fmt: skip
                if grid is not None and sinks is not None:
                    log_image_file(sinks, "val_samples", step, grid)
                return metrics
            if settings is None:
                return validate_loss(model, val_clips, cfg, dp=dp)
            assert val_score is not None
            return validate_generation(model, val_clips, settings, cfg, val_score, step=step, dp=dp)

    def export(folder: Path) -> None:  # (every rank; the weights' averages with ema_enable)
        with ema.applied() if ema is not None else contextlib.nullcontext():
            save_sharded_flow_model(model, cfg, folder, mesh=mesh)

    checkpointer = Checkpointer(
        cfg.train.ckpt,
        run_dir,
        model=FlowTrainingState(model, old, ema, reference=reset_reference),
        optimizer=optimizer,
        scheduler=scheduler,
        export=export,
    )
    start = 1
    restored = resume_checkpoint(cfg, run_dir, checkpointer)
    if restored is not None:
        start = restored.step + 1
        generator.set_state(restored.data["generators"][rank])
        if ema is not None:
            ema.steps = scheduler.last_epoch  # (the optimiser steps the averages have seen)
    metrics_path = run_dir / "metrics.jsonl"
    if lead and restored is not None and metrics_path.exists():  # (steps after it run again)
        kept = [
            line
            for line in metrics_path.read_text().splitlines(keepends=True)
            if line.endswith("\n") and json.loads(line)["step"] <= restored.step
        ]
        metrics_path.write_text("".join(kept))
    metrics = metrics_path.open("a") if lead else None
    sinks = open_loggers(cfg, run_dir, total_steps=steps) if lead else None

    def write(values: dict[str, float]) -> None:  # (the lead rank)
        assert metrics is not None and sinks is not None
        metrics.write(json.dumps(values) + "\n")
        metrics.flush()
        sinks.log(values)

    def record(values: dict[str, float]) -> None:
        step = int(values.get("iteration", values.get("step", 0)))
        values = {"step": step, **{k: v for k, v in values.items() if k != "step"}}
        values |= validate(step)
        image = grid() if every and step % every == 0 else None
        if lead:
            write(values)
            if image is not None:
                assert sinks is not None
                saved = save_samples(image, step_samples(run_dir, step))
                log_image_file(sinks, "samples", step, saved)
        if checkpointer.due(step, last=step == steps, steps_per_epoch=len(clips) // per_step):
            states: list[Any] = [generator.get_state()]
            if dp is not None:  # (every rank's noise generator)
                states = [None] * world
                dist.all_gather_object(states, generator.get_state(), group=dp.get_group())
            checkpointer.save(step, data={"generators": states})

    if start == 1 and (initial := validate(0)) and lead:  # (the weights before training)
        write({"step": 0, **initial})
    ordered = _ordered(cfg, clips, per_step)
    if settings is not None:
        assert isinstance(p, GrpoConfig) and score is not None
        log.info(
            "world-model %s: %d iterations of %d prompts x %d samples, %d clips%s%s",
            p.trainer_type, steps, per_step, settings.group_size, len(clips),
            f", colocated on {world} ranks" if mesh is not None else "",
            f", from step {start}" if start > 1 else "",
        )  # fmt: skip
        if mesh is None:
            run_flow_rl(
                model, clips, settings, score=score, on_iteration=record, prompt_clips=ordered,
                optimizer=optimizer, scheduler=scheduler, start=start, generator=generator,
                old=old, reference=reference,
            )  # fmt: skip
        else:
            run_colocated(
                model, clips, settings, mesh=mesh, score=score, prompt_clips=ordered,
                optimizer=optimizer, scheduler=scheduler, generator=generator, old=old,
                reference=reference, on_iteration=record, start=start,
            )  # fmt: skip
    else:
        log.info("world-model SFT: %d steps of %d clips, %d clips", steps, batch, len(clips))

        def on_step(values: dict[str, float]) -> None:
            if dp is not None:  # (the loss of the whole batch: the mean of the ranks')
                loss = torch.tensor([values["loss"]], dtype=torch.float64)
                sum_over(loss, dp)
                values = {**values, "loss": float(loss) / world}
            record(values)

        pretrain(
            model, clips, steps=steps, batches=lambda step: ordered(step)[rank::world],
            optimizer=optimizer, scheduler=scheduler, sigma_scheme=d.weighting_scheme,
            sigma_mean=d.logit_mean, sigma_std=d.logit_std,
            grad_clip=cfg.train.optm_grad_norm_clip, on_step=on_step, start=start,
            generator=generator,
            conditional_frames=(d.min_num_conditional_frames, d.max_num_conditional_frames),
        )  # fmt: skip
    checkpointer.close()
    if metrics is not None:
        metrics.close()
    if sinks is not None:
        sinks.close()
    final = run_dir / "safetensors" / "final"
    with ema.applied() if ema is not None else contextlib.nullcontext():  # (cosmos-rl's export)
        save_sharded_flow_model(model, cfg, final, mesh=mesh)
        image = grid()
    if lead:
        save_samples(image, run_dir / "samples.png")
        log.info("exported %s", final)
    if mesh is not None:
        close_ranks()
    return run_dir
