"""World-model RL in the runtime: the controller, rollout replicas and policy replicas of a
language-model job, running a flow model (`policy.is_diffusers`, `nebula-rl train` without
`--local`). The same controller, prompt streams, ledger, staleness bound and weight group, so
world-model RL is asynchronous and elastic: rollouts sample with weights at most
`allowed_outdated_steps` behind, a replica may die or join mid-run, and nothing is lost.

- The controller hands out the dataset's clips as prompts by index (`flow.job.flow_rows`); every
  replica reads the clips itself (captions, text embeddings, and for DDRL the real clip).
- A rollout replica (`rollout.worker.RolloutWorker` with :class:`WorldGenerator`) samples
  `rollout.n_generation` trajectories per prompt with the SDE sampler (`flow.local.roll_out`),
  the prompts it holds in one batch, scores them (in process or through the reward service; a latent-space model's samples decoded
  by its VAE first), writes each group's trajectory to its host's trajectory folder
  (`flow.trajectories`: shared memory, not JSON; a latent-space model's are latents) and pushes
  the group, with its rewards, its distance to the data and the file's name, before
  acknowledging its prompt. It hands its files to policy ranks on other hosts
  (`flow.transfer`). New weights from the
  policy are taken between batches: a trajectory is sampled with one version throughout, which
  its group records.
- A policy replica trains with :class:`FlowTrainer` in place of the language-model trainer:
  it reads the groups' trajectories (fetching those written on other hosts; when a group's are
  gone with the rollout replica that held them, the step goes back to the controller, which
  has those prompts sampled again), turns rewards into group-relative advantages and runs the
  configured algorithm (`flow.local.train_on_batch`: FlowGRPO, DDRL, DiffusionNFT), summing
  gradients with the other policy replicas; its weights go to the rollouts through the weight
  group after every step, as a language model's do.

With `validation.enable`, the controller hands the validation clips out as validation prompts at
the due steps; a rollout replica samples and scores them before its training prompts, with the
weights of the validated step (`flow.validation.scored_clips`), and pushes each clip's rewards
and distance to the data (the policy waits for them, as for language models).

With `logging.multi_modal_log_interval`, the policy's first replica draws a sample grid every that
many steps into `<run>/samples/`, which the controller hands to the `[logging]` sinks with the
step's record.

A policy replica of `policy.parallelism.dp_shard_size` ranks shards the flow model with FSDP2
(each transformer block a unit), or of `dp_replicate_size` x `dp_shard_size` ranks with HSDP,
and splits its groups between its ranks; `mini_batch` counts samples per rank. With `cp_size`,
groups of that many ranks share their groups and split each clip's frames (the built-in DiT's
context parallelism). Split rollout replicas are not built yet (the config refuses those sizes
for world models); scale rollouts with replicas (`--rollout N`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nebula_rl.config import Config, GrpoConfig, TrainingConfig
from nebula_rl.controller.client import ReplicaSession
from nebula_rl.controller.state import JobState
from nebula_rl.flow.data import Clip, clip_pixels, clip_text, save_samples
from nebula_rl.flow.ema import FlowTrainingState
from nebula_rl.flow.job import (
    flow_clips,
    flow_optimizer,
    flow_scorer,
    flow_settings,
    flow_validation_scorer,
    sample_pixels,
    step_samples,
    weight_ema,
)
from nebula_rl.flow.local import (
    FlowBatch,
    FlowRLSettings,
    RewardFn,
    data_distance,
    flow_advantages,
    pooled_std,
    roll_out,
    train_on_batch,
)
from nebula_rl.flow.models import check_flow_model, load_flow_model
from nebula_rl.flow.parallel import (
    checkpoint_blocks,
    dp_mesh,
    frozen_copy,
    sample_seed,
    save_sharded_flow_model,
    shard_flow_model,
    sum_over,
)
from nebula_rl.flow.sampler import Trajectory
from nebula_rl.flow.text_encoder import flow_text_encoder
from nebula_rl.flow.trajectories import TrajectoryStore
from nebula_rl.flow.transfer import TrajectoryServer, fetch_trajectories
from nebula_rl.flow.vae import pixels_to_samples, samples_to_pixels
from nebula_rl.flow.validation import scored_clips
from nebula_rl.policy.replicas import GroupsLost, ReplicaGroup
from nebula_rl.policy.worker import PolicyModel
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.rollout.worker import Claimed, RolloutWorker, serve, weight_receiver
from nebula_rl.weights.elastic import ElasticReceiver
from nebula_rl.weights.reshard import full_box

__all__ = [
    "FlowTrainer",
    "WorldGenerator",
    "check_flow_job",
    "flow_policy",
    "run_flow_rollout",
]

log = logging.getLogger(__name__)


def check_flow_job(cfg: Config) -> None:
    """Refuse, before anything starts, what the runtime cannot run for a flow model."""
    p = cfg.train.train_policy
    if not isinstance(p, GrpoConfig):
        raise ValueError(
            f"train.train_policy.trainer_type = {p.trainer_type!r}: world-model SFT runs in one "
            "process (the replicas run RL); `nebula-rl train --config X` runs it"
        )
    if cfg.train.train_batch_per_replica % cfg.rollout.n_generation:
        raise ValueError(
            f"train.train_batch_per_replica ({cfg.train.train_batch_per_replica}) must be a "
            f"multiple of rollout.n_generation ({cfg.rollout.n_generation}) for a world model"
        )
    par = cfg.policy.parallelism
    shards = par.dp_shard_size * par.dp_replicate_size
    if shards > 1 and cfg.groups_per_replica % shards:
        raise ValueError(
            f"policy.parallelism.dp_shard_size * dp_replicate_size = {shards} must divide the "
            f"prompts of a step per replica (train_batch_per_replica / n_generation = "
            f"{cfg.groups_per_replica})"
        )
    if cfg.validation.enable and cfg.train.ema_enable:
        raise ValueError(
            "validation.enable with train.ema_enable: in the runtime the rollout replicas "
            "validate the weights they hold, the trained ones, not their averages (which "
            "cosmos-rl validates); validate with --local or uncentralized_training, or without "
            "ema_enable"
        )
    # (checks mini_batch: samples per rank)
    flow_settings(cfg, num_iterations=1, prompts=max(1, cfg.groups_per_replica // max(shards, 1)))
    check_flow_model(cfg)


def _check_clips(train: TrainingConfig, clips: list[Clip], meta: dict[str, Any]) -> None:
    expected = meta.get("num_rows")
    if expected is not None and expected != len(clips):
        raise RuntimeError(
            f"this replica reads {len(clips)} clips of {train.train_policy.dataset.name!r}, "
            f"the controller {expected}: the replicas must see the same dataset"
        )


# -- rollout -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FlowSampling:
    """What a world-model generator (a rollout replica, a colocated replica's rank) samples with."""

    clips: list[Clip]
    """The job's clips, read from this replica's own copy (prompts come as indices)."""
    model: nn.Module
    """A frozen copy of the flow model; the policy's weights are written into it."""
    settings: FlowRLSettings
    score: RewardFn
    val_clips: list[Clip] | None
    """The validation clips (`validation.enable`), sampled for the controller's validation
    prompts (`flow.validation`)."""
    val_score: RewardFn
    """Validation's rewards (its own, else the training ones)."""


def flow_sampling(session: ReplicaSession, device: torch.device) -> FlowSampling:
    """The clips (checked against the controller's count), the frozen model, the sampler's
    settings and the rewards of a world-model generator of the job."""
    cfg = session.cfg
    run_dir = Path(session.meta["run_dir"])
    clips = flow_clips(cfg, run_dir, create=False)
    _check_clips(cfg.train, clips, session.meta)
    model = load_flow_model(cfg, seed=cfg.train.seed or 0).to(device).eval()
    model.requires_grad_(False)
    p = cfg.train.train_policy
    assert isinstance(p, GrpoConfig)
    score = flow_scorer(p)
    val_clips, val_score = None, score  # (without validation.enable: never called)
    if cfg.validation.enable:
        val_clips = flow_clips(cfg, run_dir, create=False, validation=True)
        validation_score = flow_validation_scorer(cfg.validation, score)
        assert validation_score is not None  # (the training rewards at least)
        val_score = validation_score
    settings = flow_settings(cfg, num_iterations=1, prompts=cfg.groups_per_replica)
    return FlowSampling(clips, model, settings, score, val_clips, val_score)


def trajectory_server(session: ReplicaSession) -> TrajectoryServer:
    """The job's trajectory folder on this host, served by this replica to policy ranks on
    other hosts (`TrajectoryServer.start` starts it)."""
    store = TrajectoryStore.for_job(Path(session.meta["run_dir"]))
    timeout = session.cfg.controller.collective_timeout
    return TrajectoryServer(session.state, session.name, store, timeout=timeout)


class WorldGenerator:
    """A world model's rollout generation: sample, score, store, push (the rollout worker's
    :class:`~nebula_rl.rollout.worker.Generator`). Prompts taken wait for the next batch;
    :meth:`collect` samples them, validation prompts on their own, before the others."""

    def __init__(self, session: ReplicaSession, *, device: torch.device) -> None:
        self.session = session
        self.cfg = cfg = session.cfg
        self.sampling = flow_sampling(session, device)
        self.server = trajectory_server(session)
        """Hands this replica's trajectory files to policy ranks on other hosts."""
        base = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.train.seed
        self.generator = torch.Generator(device=device).manual_seed(
            (base or 0) + 1000 * session.registration["replica_id"]
        )
        self.claim_limit = max(1, cfg.rollout.batch_size)
        """Prompts sampled together (and held at most)."""
        self.taken: list[Claimed] = []
        self.lock = threading.Lock()
        """Held while sampling and while new weights are written."""
        self.version = 0
        self.damaged = False

    @property
    def policy_version(self) -> int:
        return self.version

    def stats(self) -> dict[str, float]:
        return {}

    def receiver(self, session: ReplicaSession) -> ElasticReceiver:
        """Every push is taken between two batches: a trajectory is sampled with one version."""
        params = dict(self.sampling.model.named_parameters())
        boxes = {name: (tuple(t.shape), full_box(t.shape)) for name, t in params.items()}

        def apply(receive: Callable[[], int | None]) -> None:
            with self.lock, torch.no_grad():
                version = receive()
            self.damaged = version is None
            if version is None:
                log.warning("a weight push failed part-way: sampling nothing until the next")
            else:
                self.version = version
                log.info("weights of version %d in place", version)

        device = next(self.sampling.model.parameters()).device
        return weight_receiver(session, params, boxes, device=device, apply=apply)

    def start(self) -> None:
        self.server.start()

    def prepare(self, msg_id: str, prompt: Prompt) -> Claimed:
        return Claimed(msg_id, prompt)  # (the replica reads the clips itself)

    def submit(self, claimed: Sequence[Claimed]) -> int:
        self.taken.extend(claimed)
        return 0

    def in_flight(self) -> int:
        return len(self.taken)

    def busy(self) -> bool:
        return bool(self.taken)

    def collect(self, timeout_s: float) -> int:
        """Sample the prompts taken as one batch (the validation prompts among them first, on
        their own) with the weights in place, unless a push failed part-way; push the groups."""
        validating = [c for c in self.taken if c.prompt.validation_step is not None]
        training = [c for c in self.taken if c.prompt.validation_step is None]
        s, n = self.sampling, self.cfg.rollout.n_generation
        if self.damaged:
            time.sleep(min(timeout_s, 0.01))
            return 0
        with self.lock:
            if self.damaged:  # (a push failed since)
                return 0
            version = self.version
            if validating:
                self._validate(validating, version)
                self.taken = training
                return len(validating)
            real = [s.clips[c.prompt.index] for c in training for _ in range(n)]
            *_, trajectory = roll_out(s.model, real, s.settings, self.generator)
        self.taken = []
        groups = scored_groups(s.model, trajectory, real, n, s.clips, s.score)
        for c, group in zip(training, groups, strict=True):
            push_group(self.session, self.server, c.msg_id, c.prompt, group, version)
        return len(training)

    def _validate(self, ready: list[Claimed], version: int) -> None:
        """Sample and score validation prompts (`flow.validation.scored_clips`) and push each
        clip's group: its rewards (none, as a failed answer, when they were lost) and its
        samples' mean distance to the data."""
        s = self.sampling
        assert s.val_clips is not None
        indices = [c.prompt.index for c in ready]
        results = scored_clips(s.model, s.val_clips, indices, s.settings, self.cfg, s.val_score)
        for c, (rewards, distances) in zip(ready, results, strict=True):
            push_validated(self.session, c.msg_id, c.prompt, rewards, distances, version)

    def close(self, *, job_ended: bool) -> None:
        self.server.stop(job_ended=job_ended)


def run_flow_rollout(session: ReplicaSession, *, device: torch.device) -> None:
    """Body of a world-model rollout replica's process."""
    serve(RolloutWorker(session, WorldGenerator(session, device=device)))


@dataclasses.dataclass(frozen=True, slots=True)
class SampledGroup:
    """One prompt's group as a world-model generator made it: its trajectory (on the CPU), its
    samples' rewards, their mean distance to the data (None for a prompt dataset), and whether
    the rewards were lost (then zeros)."""

    trajectory: Trajectory
    rewards: list[float]
    distance: float | None
    lost: bool


def scored_groups(
    model: nn.Module,
    trajectory: Trajectory,
    real: list[Clip],
    n: int,
    clips: list[Clip],
    score: RewardFn,
) -> list[SampledGroup]:
    """The groups of `n` consecutive samples of `trajectory` (sampled for `real`, each prompt's
    clip `n` times), decoded (a latent-space model's by its VAE) and scored."""
    captions = [c.caption for c in real]
    pixels = samples_to_pixels(model, trajectory.final).float().cpu()
    scored = score(pixels, captions)
    groups = []
    for k in range(len(real) // n):
        rows = slice(k * n, (k + 1) * n)
        part = Trajectory(
            latents=trajectory.latents[rows].cpu(),
            log_probs=trajectory.log_probs[rows].cpu(),
            sigmas=trajectory.sigmas.cpu(),
            noise_level=trajectory.noise_level,
            given=None if trajectory.given is None else trajectory.given[rows].cpu(),
        )
        rewards = [0.0] * n if scored is None else scored[rows]
        distance = data_distance(pixels[rows], captions[rows], clips)
        groups.append(SampledGroup(part, rewards, distance, scored is None))
    return groups


def push_group(
    session: ReplicaSession,
    server: TrajectoryServer,
    msg_id: str,
    prompt: Prompt,
    group: SampledGroup,
    version: int,
) -> None:
    """Store the group's trajectory (in `server`'s folder), push the group (with its mean distance to the data), then
    acknowledge its prompt (a crash in between duplicates the group, which the controller keeps
    once; it loses nothing)."""
    name = server.store.write(prompt.prompt_id, group.trajectory)
    server.wrote(name, prompt)
    completions = [
        Completion([], [], "", "stop", [(0, version)], reward=float(r)) for r in group.rewards
    ]
    extra: dict[str, Any] = {"trajectory": name}
    if group.distance is not None:  # (none for a prompt dataset)
        extra["data_distance"] = group.distance
    if group.lost:
        extra["rewards_lost"] = True
    state = session.state
    state.push_group(RolloutGroup(prompt, [], completions, session.name, extra))
    state.ack_prompts([msg_id])


def push_validated(
    session: ReplicaSession,
    msg_id: str,
    prompt: Prompt,
    rewards: list[float] | None,
    distances: list[float],
    version: int,
) -> None:
    """Push a validation clip's group (`flow.validation.scored_clips`: its rewards, none when
    they were lost, and its samples' mean distance to the data), then acknowledge it."""
    n = session.cfg.validation.n_generation
    completions = [
        Completion([], [], "", "stop", [(0, version)], reward=float(r))
        for r in (rewards if rewards is not None else [0.0] * n)
    ]
    extra: dict[str, Any] = {}
    if distances:  # (none for a prompt dataset)
        extra["data_distance"] = sum(distances) / len(distances)
    if rewards is None:
        extra["error"] = "the validation rewards were lost"
    session.state.push_group(RolloutGroup(prompt, [], completions, session.name, extra))
    session.state.ack_validation([msg_id])


# -- policy --------------------------------------------------------------------------------------


class FlowTrainer:
    """The policy replica's trainer for a flow model: what `PolicyWorker` asks of the
    language-model trainer (`grpo_step`, the optimiser and schedule, the replica group)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Config,
        *,
        clips: list[Clip],
        store: TrajectoryStore,
        total_steps: int,
        run_dir: Path,
        mesh: DeviceMesh | None = None,
        state: JobState | None = None,
    ) -> None:
        self.model, self.cfg, self.clips, self.store = model, cfg, clips, store
        self.state = state
        """The job's state, to fetch trajectories from rollout replicas on other hosts (None:
        every file must be in `store`)."""
        self.run_dir = run_dir
        self.mesh = mesh
        """The replica's ranks the model is sharded over (None: one process)."""
        self.dp = None if mesh is None else dp_mesh(mesh)
        """Every data-parallel rank of the replica (HSDP's copies too), each with its groups."""
        self.dp_rank = 0 if self.dp is None else self.dp.get_local_rank()
        self.dp_size = 1 if self.dp is None else self.dp.size()
        s = self.settings = flow_settings(
            cfg, num_iterations=total_steps, prompts=max(1, cfg.groups_per_replica // self.dp_size)
        )
        self.optimizer, self.scheduler = flow_optimizer(
            cfg.train, model, total_steps * s.num_minibatches
        )
        self.ema = weight_ema(cfg.train, model, self.optimizer)
        """`train.ema_enable`: the averages exports hold."""
        self.generator = torch.Generator().manual_seed(s.seed)
        self.replicas: ReplicaGroup | None = None
        """The other policy replicas of the step (gradients and metrics are summed)."""
        self.planned_updates: int | None = None
        """Optimiser updates of the step in progress."""
        self.device = next(model.parameters()).device
        self.reference = self._frozen_copy() if s.kl_beta > 0 else None
        """FlowGRPO's KL reference: the starting weights (reset every
        `reference_reset_interval` iterations when set)."""
        self.old = self._frozen_copy() if s.algorithm == "nft" else None
        """DiffusionNFT's old weights."""
        reset = self.reference if s.reference_reset_interval else None
        self.checkpoint_module = FlowTrainingState(model, self.old, self.ema, reference=reset)
        """What the policy's checkpoints save and load (the model, the old weights, the
        averages; the optimiser and the schedule come with them)."""

    def resumed(self) -> None:
        """After a checkpoint was loaded into `checkpoint_module`: the averages have seen the
        restored optimiser steps."""
        if self.ema is not None:
            self.ema.steps = self.scheduler.last_epoch

    def _frozen_copy(self) -> nn.Module:
        return frozen_copy(self.model, self.cfg, mesh=self.mesh)

    def _sync_grads(self) -> None:
        """The mean gradient over the replicas (each trained on its own groups; FSDP2 already
        averaged it over the replica's ranks)."""
        if self.replicas is None:
            return
        self.replicas.all_reduce_grads(self.model.parameters())
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.div_(self.replicas.size)

    def _trajectories(
        self, groups: list[RolloutGroup], mine: list[RolloutGroup]
    ) -> list[Trajectory]:
        """The trajectories of `mine`, this rank's share of the replica's `groups`: from this
        host's folder, else from the rollout replicas that wrote them. Raises `GroupsLost` on
        every rank of every replica (they agree first) when any rank lacks one, naming this
        replica's lost groups."""
        found: dict[str, Trajectory | None] = {}
        wanted: dict[str, list[str]] = {}
        for g in mine:
            file = g.extra["trajectory"]
            if (self.store.root / file).is_file():
                found[file] = self.store.read(file)
            elif self.state is not None:
                wanted.setdefault(g.replica, []).append(file)
            else:
                found[file] = None
        if wanted:
            assert self.state is not None
            timeout = self.cfg.controller.collective_timeout
            found |= fetch_trajectories(self.state, wanted, timeout=timeout)
        # Which of the replica's groups are lost, agreed by its ranks and then all replicas.
        lost = torch.zeros(len(groups), dtype=torch.float64)
        for k, g in enumerate(mine):
            lost[self.dp_rank + k * self.dp_size] = found[g.extra["trajectory"]] is None
        if self.dp is not None:
            sum_over(lost, self.dp)
        total = lost.sum().reshape(1)
        if self.replicas is not None:
            self.replicas.sum_(total)
        if total.item() > 0:
            raise GroupsLost(
                [g.prompt.prompt_id for g, n in zip(groups, lost, strict=True) if n > 0]
            )
        return [t for t in (found[g.extra["trajectory"]] for g in mine) if t is not None]

    def _batch_std(self, groups: list[RolloutGroup]) -> float:
        """The std of the rewards of the whole step (`global_std`): over this replica's groups
        and the other replicas'."""
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
        sums = torch.stack([rewards.sum(), rewards.square().sum(), torch.tensor(len(rewards))])
        if self.replicas is not None:
            self.replicas.sum_(sums)
        total, squares, n = sums.tolist()
        return pooled_std(total, squares, n, population=self.settings.population_std)

    def grpo_step(self, groups: list[RolloutGroup], media: Any = None) -> dict[str, float]:
        """Train on this replica's share of a step; the step's metrics over every replica."""
        s = self.settings
        self.planned_updates = s.num_minibatches
        mine = groups[self.dp_rank :: self.dp_size]  # (this rank's share of the replica's)
        if not mine:
            raise ValueError("a world-model step gave this policy rank no groups")
        trajectories = self._trajectories(groups, mine)
        batch_std = self._batch_std(groups) if s.global_std else None
        groups = mine
        first = trajectories[0]
        for group, t in zip(groups, trajectories, strict=True):
            if (
                len(group.completions) != s.group_size
                or not torch.equal(t.sigmas, first.sigmas)
                or (t.given is None) != (first.given is None)
            ):
                raise ValueError(
                    f"group {group.prompt.prompt_id} was sampled with other settings "
                    f"({len(group.completions)} samples, sigmas {t.sigmas.tolist()}, "
                    f"conditioning frames {'none' if t.given is None else 'drawn'})"
                )
        real = [self.clips[g.prompt.index] for g in groups for _ in range(s.group_size)]
        device = self.device
        text, mask = (t.to(device) for t in clip_text(real, flow_text_encoder(self.model)))
        x0 = None
        if s.data_beta > 0:  # (DDRL's data)
            x0 = pixels_to_samples(self.model, clip_pixels(real).to(device))
        given = None
        if first.given is not None:  # (conditioning frames: every group has them, checked above)
            given = torch.cat([t.given for t in trajectories if t.given is not None]).to(device)
        trajectory = Trajectory(
            latents=torch.cat([t.latents for t in trajectories]).to(device),
            log_probs=torch.cat([t.log_probs for t in trajectories]).to(device),
            sigmas=first.sigmas.to(device),
            noise_level=first.noise_level,
            given=given,
        )
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        advantages = flow_advantages(rewards, s.group_size, s, batch_std=batch_std).to(device)
        prompts = [c.caption for c in real]
        iteration = self.scheduler.last_epoch // s.num_minibatches + 1
        seeds = [  # (DiffusionNFT's noise: by sample and step, whichever rank trains it)
            sample_seed(s.seed, iteration, g.prompt.prompt_id, k)
            for g in groups
            for k in range(s.group_size)
        ]
        batch = FlowBatch(prompts, x0, text, mask, trajectory, advantages, noise_seeds=seeds)
        losses, clipped = train_on_batch(
            self.model,
            self.optimizer,
            batch,
            s,
            self.generator,
            iteration=iteration,
            reference=self.reference,
            old=self.old,
            scheduler=self.scheduler,
            sync_grads=self._sync_grads,
        )
        count = float(len(rewards))
        sums = torch.tensor(
            [
                float(rewards.sum()),
                float((rewards**2).sum()),
                count,
                sum(losses) / len(losses) * count,
                clipped * count,
                sum(float(g.extra.get("data_distance", 0.0)) for g in groups) * s.group_size,
                float(sum(bool(g.extra.get("rewards_lost")) for g in groups)),
                float(len(groups)),
                float(sum("data_distance" in g.extra for g in groups) * s.group_size),
            ],
            dtype=torch.float64,
        )
        if self.dp is not None:
            sum_over(sums, self.dp)
        if self.replicas is not None:
            self.replicas.sum_(sums)
        every = self.cfg.logging.multi_modal_log_interval
        if every and iteration % every == 0 and (self.replicas is None or self.replicas.rank == 0):
            self._draw_samples(iteration)  # (every rank of the replica: a sharded forward)
        total, squares, n, loss, clip, distance, lost, num_groups, measured = sums.tolist()
        mean = total / n
        out = {
            "reward_mean": mean,
            "reward_std": max(squares / n - mean * mean, 0.0) ** 0.5,
            "loss": loss / n,
            "clip_frac": clip / n,
            "rewards_lost": lost / num_groups,
            "lr": self.scheduler.get_last_lr()[0],
        }
        if measured:  # (a prompt dataset's samples have no data to be near)
            out["data_distance"] = distance / measured
        return out

    def _draw_samples(self, step: int) -> None:
        """The sample grid of `step` to `<run>/samples/step_<N>.png` (an animated `.gif` beside
        it for videos); the controller hands them to the `[logging]` sinks when it records the
        step."""
        d = self.cfg.policy.diffusers
        pixels = sample_pixels(
            self.model, self.clips, num_steps=d.sample.eval_num_steps, shift=d.train_flow_shift
        )
        if self.mesh is None or dist.get_rank() == 0:  # (not every rank of a CP group)
            save_samples(pixels, step_samples(self.run_dir, step))


def flow_policy(session: ReplicaSession, device: torch.device) -> PolicyModel:
    """A world-model policy replica's model (FSDP2-sharded over the replica's ranks when it has
    several), trainer (fetching trajectories through the job's state from rollout replicas on
    other hosts), and export (`safetensors/...` folders loadable as `policy.model_name_or_path`;
    every rank of the replica calls it, its rank 0 writes): the policy loop's
    :data:`~nebula_rl.policy.worker.PolicyBuilder` for world models."""
    cfg, meta, state = session.cfg, session.meta, session.state
    run_dir = Path(meta["run_dir"])
    clips = flow_clips(cfg, run_dir, create=False)
    _check_clips(cfg.train, clips, meta)
    seed = cfg.train.seed or 0
    model = load_flow_model(cfg, seed=seed).to(device)
    if cfg.policy.model_gradient_checkpointing:
        checkpoint_blocks(model)
    par = cfg.policy.parallelism
    mesh = shard_flow_model(model, device, replicate=par.dp_replicate_size, cp=par.cp_size)
    trainer = FlowTrainer(
        model,
        cfg,
        clips=clips,
        store=TrajectoryStore.for_job(run_dir),
        total_steps=meta["total_steps"],
        run_dir=run_dir,
        mesh=mesh,
        state=state,
    )

    def export(folder: Path) -> None:  # (the weights' averages with train.ema_enable)
        with trainer.ema.applied() if trainer.ema is not None else contextlib.nullcontext():
            save_sharded_flow_model(model, cfg, folder, mesh=mesh)

    # (the checkpoint holds the old weights and the averages beside the model)
    return PolicyModel(
        model, trainer, export, saved=trainer.checkpoint_module, resumed=trainer.resumed
    )
