"""A world-model run from its config (`policy.is_diffusers = true`) in this job:
`nebula-rl train --config X` for SFT (`trainer_type = "diffusers_sft"`), with `--local` or
`uncentralized_training` for RL (`"flow_grpo"`, `"ddrl"`, `"diffusion_nft"`). One process, or
`policy.parallelism.dp_shard_size` ranks over which the model is FSDP2-sharded (or
`dp_replicate_size` x `dp_shard_size` ranks, HSDP) (SFT, and uncentralized colocated RL:
`nebula_rl.flow.uncentralized`).

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
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from PIL import Image
from torch import Tensor

from nebula_rl.config import FLOW_RL_TRAINERS, Config, GrpoConfig, TrainingConfig, ValidationConfig
from nebula_rl.config.base import reward_weights
from nebula_rl.data import epoch_order, num_train_steps
from nebula_rl.flow.clips import dataset_entries
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
from nebula_rl.flow.local import FlowRLSettings, RewardFn, rl_iteration, sft_step
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
from nebula_rl.flow.uncentralized import colocated_iteration
from nebula_rl.flow.vae import sample_shape, samples_to_pixels
from nebula_rl.flow.validation import validate_generation, validate_loss, validate_samples
from nebula_rl.policy.checkpoint import Checkpointer, resume_checkpoint
from nebula_rl.policy.loop import train_steps
from nebula_rl.policy.optim import build_optimizer, lr_lambda
from nebula_rl.rewards.visual import VISUAL_REWARDS, pixels_from_samples
from nebula_rl.utils.metrics_log import MetricsWriter, log_image_file
from nebula_rl.utils.ranks import close_ranks, init_ranks, rank_env
from nebula_rl.utils.runs import resolve_run_dir

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


def _ordered(train: TrainingConfig, clips: list[Clip], per_step: int) -> Any:
    """`batch(step)`: the clips of step `step` (1-based), epochs in seeded shuffled orders."""
    per_epoch = len(clips) // per_step
    seed = train.seed or 0

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
    train: TrainingConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> WeightEMA | None:
    """With `train.ema_enable`, the averages of `model`'s weights, moved after each step of
    `optimizer`."""
    t = train
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


def flow_validation_scorer(
    validation: ValidationConfig, training: RewardFn | None
) -> RewardFn | None:
    """The rewards of validation: `validation.reward_function`'s, computed here, else the
    training ones (`training`; SFT's: None)."""
    weights = reward_weights(validation.reward_function)
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


def flow_optimizer(
    train: TrainingConfig, model: torch.nn.Module, total_steps: int
) -> tuple[Any, Any]:
    optimizer = build_optimizer(model, train)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train, total_steps))


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
    (`--local`) is one process unless uncentralized (`flow.uncentralized`)."""
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
    p = cfg.train.train_policy
    if split and isinstance(p, GrpoConfig) and not p.uncentralized_training:
        raise ValueError(
            f"policy.parallelism.{', '.join(split)}: `--local` world-model RL is one "
            "process; run without --local: policy replicas of that split with rollout "
            'replicas, or with mode = "colocated" policy replicas that sample too (and '
            "train.train_policy.uncentralized_training = true: in this job's ranks, without "
            "the controller)"
        )


def run(cfg: Config) -> Path:
    """Run the world-model config `cfg` in this process (one of its ranks); its run folder."""
    check_ranks(cfg)
    return _FlowRun(cfg).run()


@dataclasses.dataclass
class _Plan:
    """How many steps a run takes, of how many clips (prompts for RL), and its RL settings."""

    steps: int
    per_step: int
    updates: int
    """Optimiser updates (the LR schedule's length)."""
    settings: FlowRLSettings | None = None
    """RL only."""
    old: Any = None
    """DiffusionNFT's old policy."""
    reference: Any = None
    """The KL reference (kl_beta > 0)."""
    reset_reference: Any = None
    """The reference, when it is reset during the run (then checkpoints hold it)."""


class _FlowRun:
    """One world-model run in this process (one rank of it): the data, the model (sharded over
    the ranks), the optimiser, checkpoints, validation and the metric sinks; its steps
    (`policy.loop.Steps`) are RL iterations or SFT steps."""

    # (train.save_ckpt_at_exit is the language models' for now)
    on_signal: Literal["stop", "continue"] | None = None

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        ranks = rank_env()
        cuda = torch.cuda.is_available()
        if ranks.world_size > 1:
            init_ranks("nccl" if cuda else "gloo")
        self.lead = lead = ranks.rank == 0
        device = torch.device("cuda", ranks.local_rank) if cuda else torch.device("cpu")
        self.run_dir = run_dir = resolve_run_dir(cfg.train)
        if lead:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        seed = cfg.train.seed or 0
        torch.manual_seed(seed)
        self.clips, self.val_clips = self._clips(ranks.world_size)
        model = self.model = load_flow_model(cfg, seed=seed).to(device)
        if cfg.policy.model_gradient_checkpointing:
            checkpoint_blocks(model)
        par = cfg.policy.parallelism
        self.mesh = shard_flow_model(model, device, replicate=par.dp_replicate_size, cp=par.cp_size)
        self.dp = None if self.mesh is None else dp_mesh(self.mesh)
        self.rank, self.world = (
            (0, 1) if self.dp is None else (self.dp.get_local_rank(), self.dp.size())
        )
        self.generator = torch.Generator().manual_seed(seed + 1000 * self.rank)  # (own noise)
        self.plan = self._plan()
        self.total = self.plan.steps
        self.steps_per_epoch = len(self.clips) // self.plan.per_step
        self.optimizer, self.scheduler = flow_optimizer(cfg.train, model, self.plan.updates)
        self.ema = weight_ema(cfg.train, model, self.optimizer)
        p = cfg.train.train_policy
        self.score = flow_scorer(p) if isinstance(p, GrpoConfig) else None
        self.val_score = (
            flow_validation_scorer(cfg.validation, self.score) if cfg.validation.enable else None
        )
        self.val_prompts = bool(self.val_clips) and all(c.video is None for c in self.val_clips)
        self.checkpointer = Checkpointer(
            cfg.train.ckpt,
            run_dir,
            model=FlowTrainingState(
                model, self.plan.old, self.ema, reference=self.plan.reset_reference
            ),
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            export=self.export,
        )
        self.start = 0
        restored = resume_checkpoint(cfg.train, run_dir, self.checkpointer)
        if restored is not None:
            self.start = restored.step
            self.generator.set_state(restored.data["generators"][self.rank])
            if self.ema is not None:
                self.ema.steps = self.scheduler.last_epoch  # (the optimiser steps it has seen)
        self.writer = (
            MetricsWriter(
                cfg,
                run_dir,
                total_steps=self.plan.steps,
                after_step=None if restored is None else restored.step,
            )
            if lead
            else None
        )

    def _clips(self, world_size: int) -> tuple[list[Clip], list[Clip]]:
        """The training and validation clips (the lead rank writes a toy dataset first)."""
        cfg, run_dir, validating = self.cfg, self.run_dir, self.cfg.validation.enable
        if self.lead:
            clips = flow_clips(cfg, run_dir, create=True)
            val_clips = flow_clips(cfg, run_dir, validation=True) if validating else []
        if world_size > 1:
            dist.barrier()  # (the toy datasets are written)
        if not self.lead:
            clips = flow_clips(cfg, run_dir, create=False)
            val_clips = (
                flow_clips(cfg, run_dir, create=False, validation=True) if validating else []
            )
        return clips, val_clips

    def _plan(self) -> _Plan:
        """The run's length and, for RL, its settings and frozen copies (old policy, reference:
        the starting weights, copied before a checkpoint is loaded)."""
        cfg, world, p = self.cfg, self.world, self.cfg.train.train_policy
        batch = cfg.train.train_batch_per_replica
        if not isinstance(p, GrpoConfig):
            if batch % world:
                raise ValueError(
                    f"policy.parallelism's data-parallel ranks ({world}: dp_shard_size * "
                    f"dp_replicate_size) must divide train.train_batch_per_replica ({batch})"
                )
            steps = num_train_steps(cfg.train, len(self.clips), items_per_step=batch)
            return _Plan(steps, batch, steps)
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
        steps = num_train_steps(cfg.train, len(self.clips), items_per_step=prompts)
        settings = flow_settings(cfg, num_iterations=steps, prompts=prompts // world)
        model, mesh = self.model, self.mesh
        old = frozen_copy(model, cfg, mesh=mesh) if settings.algorithm == "nft" else None
        reference = frozen_copy(model, cfg, mesh=mesh) if settings.kl_beta > 0 else None
        return _Plan(
            steps,
            prompts,
            steps * settings.num_minibatches,
            settings,
            old,
            reference,
            reference if settings.reference_reset_interval else None,
        )

    @property
    def sinks(self) -> Any:
        """The lead rank's metric sinks (None on the others)."""
        return None if self.writer is None else self.writer.loggers

    def _averaged(self) -> contextlib.AbstractContextManager[Any]:
        """The weights' averages in place, with `train.ema_enable`."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()

    def grid(self) -> Tensor:
        """Samples of the training clips (every rank: a sharded model's forward is collective)."""
        d = self.cfg.policy.diffusers
        return sample_pixels(
            self.model, self.clips, num_steps=d.sample.eval_num_steps, shift=d.train_flow_shift
        )

    def validate(self, step: int) -> dict[str, float]:
        """Validation's metrics at `step` (every rank: a sharded model's forwards; the loop
        calls it when `[validation]` is due)."""
        cfg, model, dp = self.cfg, self.model, self.dp
        with self._averaged():
            if self.plan.settings is None and self.val_prompts:  # (SFT on captions: samples)
                metrics, grid = validate_samples(
                    model, self.val_clips, cfg, step=step, run_dir=self.run_dir,
                    score=self.val_score, dp=dp, write=self.lead,
                )  # fmt: skip
                if grid is not None and self.sinks is not None:
                    log_image_file(self.sinks, "val_samples", step, grid)
                return metrics
            if self.plan.settings is None:
                return validate_loss(model, self.val_clips, cfg, dp=dp)
            assert self.val_score is not None
            return validate_generation(
                model, self.val_clips, self.plan.settings, cfg, self.val_score, step=step, dp=dp
            )

    def export(self, folder: Path) -> None:
        """Save the model (every rank; the weights' averages with ema_enable)."""
        with self._averaged():
            save_sharded_flow_model(self.model, self.cfg, folder, mesh=self.mesh)

    def step(self, step: int) -> dict[str, Any]:
        """Take step (RL: iteration) `step` on this rank; its record."""
        plan, settings, clips = self.plan, self.plan.settings, self.ordered(step)
        if settings is None:
            return {"step": step, "loss": self._sft_step(clips)}
        assert self.score is not None
        if self.dp is None:
            record = rl_iteration(
                self.model, [c for c in clips for _ in range(settings.group_size)], self.clips,
                settings, step, score=self.score, optimizer=self.optimizer,
                scheduler=self.scheduler, generator=self.generator, old=plan.old,
                reference=plan.reference,
            )  # fmt: skip
        else:  # (uncentralized colocated RL on several ranks)
            record = colocated_iteration(
                self.model, clips, self.clips, settings, step, dp=self.dp, score=self.score,
                optimizer=self.optimizer, scheduler=self.scheduler, generator=self.generator,
                old=plan.old, reference=plan.reference,
            )  # fmt: skip
        return {"step": step, **record}

    def _sft_step(self, clips: list[Clip]) -> float:
        """A flow-matching step on this rank's share of `clips`; the loss of the whole batch."""
        cfg, dp, world = self.cfg, self.dp, self.world
        d = cfg.policy.diffusers
        loss = sft_step(
            self.model, clips[self.rank :: world], self.optimizer, self.generator,
            scheduler=self.scheduler, sigma_scheme=d.weighting_scheme, sigma_mean=d.logit_mean,
            sigma_std=d.logit_std, grad_clip=cfg.train.optm_grad_norm_clip,
            conditional_frames=(d.min_num_conditional_frames, d.max_num_conditional_frames),
        )  # fmt: skip
        if dp is None:
            return loss
        total = torch.tensor([loss], dtype=torch.float64)  # (the mean of the ranks')
        sum_over(total, dp)
        return float(total) / world

    def recorded(self, step: int) -> None:
        """Sample grids every `logging.multi_modal_log_interval` steps."""
        every = self.cfg.logging.multi_modal_log_interval
        if not every or step % every:
            return
        image = self.grid()
        if self.lead:
            assert self.sinks is not None
            saved = save_samples(image, step_samples(self.run_dir, step))
            log_image_file(self.sinks, "samples", step, saved)

    def state(self) -> dict[str, Any]:
        """Every rank's noise generator, for a checkpoint."""
        states: list[Any] = [self.generator.get_state()]
        if self.dp is not None:
            states = [None] * self.world
            dist.all_gather_object(states, self.generator.get_state(), group=self.dp.get_group())
        return {"generators": states}

    def run(self) -> Path:
        """Train to the end, export; the run folder."""
        self.ordered = _ordered(self.cfg.train, self.clips, self.plan.per_step)
        self._announce()
        train_steps(
            self, self.cfg, start=self.start, checkpointer=self.checkpointer, writer=self.writer
        )
        final = self.run_dir / "safetensors" / "final"
        with self._averaged():  # (cosmos-rl's export)
            save_sharded_flow_model(self.model, self.cfg, final, mesh=self.mesh)
            image = self.grid()
        if self.lead:
            save_samples(image, self.run_dir / "samples.png")
            log.info("exported %s", final)
        if self.mesh is not None:
            close_ranks()
        return self.run_dir

    def _announce(self) -> None:
        cfg, plan, settings = self.cfg, self.plan, self.plan.settings
        if settings is None:
            log.info(
                "world-model SFT: %d steps of %d clips, %d clips",
                plan.steps, cfg.train.train_batch_per_replica, len(self.clips),
            )  # fmt: skip
            return
        log.info(
            "world-model %s: %d iterations of %d prompts x %d samples, %d clips%s%s",
            cfg.train.train_policy.trainer_type, plan.steps, plan.per_step, settings.group_size,
            len(self.clips), f", colocated on {self.world} ranks" if self.mesh is not None else "",
            f", from step {self.start + 1}" if self.start else "",
        )  # fmt: skip
