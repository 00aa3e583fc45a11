"""Uncentralized colocated world-model RL (`mode = "colocated"` with
`train.train_policy.uncentralized_training = true`, as cosmos-rl's diffusion NFT configs ship):
the policy's ranks sample their own rollouts, score them and train on them, taking turns, in
`nebula-rl train`'s own ranks, with the flow model FSDP2-sharded over them
(`policy.parallelism.dp_shard_size` processes, or HSDP with `dp_replicate_size` copies of such
shards). No controller, no replicas, no weight push: the weights that train are the weights that
sample. (Without `uncentralized_training`, a colocated job's groups go through the controller:
`policy.colocated`.)

Each iteration every rank takes its share of the iteration's prompts (`prompts[rank::ranks]`),
samples `group_size` trajectories of each with its own noise, and scores them (a latent-space
model's decoded by its VAE, which each rank holds whole); the advantages are group-relative (with
`global_std`, over the rewards of every rank); then `flow.local.train_on_batch` trains its share,
FSDP2 averaging the gradients. DiffusionNFT's training noise is seeded per sample, and the
records sum over the ranks, so the numbers are those of the whole iteration.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nebula_rl.flow.data import Clip
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
from nebula_rl.flow.parallel import sample_seed, sum_over
from nebula_rl.flow.vae import samples_to_pixels
from nebula_rl.utils.ranks import cpu_threads

__all__ = ["colocated_iteration"]


def colocated_iteration(
    model: nn.Module,
    everyone: list[Clip],
    clips: list[Clip],
    s: FlowRLSettings,
    iteration: int,
    *,
    dp: DeviceMesh,
    score: RewardFn,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
    old: nn.Module | None,
    reference: nn.Module | None,
) -> dict[str, float]:
    """One iteration of `model` (sharded over the data-parallel mesh `dp`) with
    `s.algorithm` on this rank's share of the prompts `everyone` (all ranks', the same list on
    every rank), this rank's noise from `generator`; the iteration's record, the same on every
    rank. `old` is DiffusionNFT's old weights and `reference` the KL's
    (`flow.parallel.frozen_copy`: sharded like `model`), each None where not used."""
    rank, ranks = dp.get_local_rank(), dp.size()
    device = next(model.parameters()).device
    mine = everyone[rank::ranks]
    if not mine:
        raise ValueError(
            f"iteration {iteration}: {len(everyone)} prompts for {ranks} ranks; "
            "policy.parallelism.dp_shard_size must not exceed the prompts of a step"
        )
    real = [c for c in mine for _ in range(s.group_size)]
    prompts = [c.caption for c in real]
    with cpu_threads(s.rollout_threads):
        x0, text, mask, trajectory = roll_out(model, real, s, generator)
    pixels = samples_to_pixels(model, trajectory.final).float().cpu()
    scored = score(pixels, prompts)
    rewards = torch.tensor(scored if scored is not None else [0.0] * len(prompts))
    stats = torch.tensor(
        [float(rewards.sum()), float(rewards.square().sum()), float(len(rewards))],
        dtype=torch.float64,
    )
    sum_over(stats, dp)
    total, squares, n = stats.tolist()
    batch_std = pooled_std(total, squares, n, population=s.population_std)
    advantages = flow_advantages(rewards, s.group_size, s, batch_std=batch_std).to(device)
    seeds = [
        sample_seed(s.seed, iteration, f"{(rank + ranks * i)}:{c.stem}", k)
        for i, c in enumerate(mine)
        for k in range(s.group_size)
    ]
    batch = FlowBatch(prompts, x0, text, mask, trajectory, advantages, noise_seeds=seeds)
    with cpu_threads(s.train_threads):
        losses, clipped = train_on_batch(
            model, optimizer, batch, s, generator, iteration=iteration, reference=reference,
            old=old, scheduler=scheduler,
        )  # fmt: skip
    count = float(len(rewards))
    near = data_distance(pixels, prompts, clips)  # (None for a prompt dataset: on every rank)
    sums = torch.tensor(
        [
            sum(losses) / len(losses) * count,
            clipped * count,
            (near or 0.0) * count,
            float(scored is None),
        ],
        dtype=torch.float64,
    )
    sum_over(sums, dp)
    loss, clip, distance, lost = sums.tolist()
    mean = total / n
    record = {
        "iteration": float(iteration),
        "reward_mean": mean,
        "reward_std": batch_std,
        "rewards_lost": lost / ranks,
        "loss": loss / n,
        "clip_fraction": clip / n,
    }
    if near is not None:  # (a prompt dataset's samples have no data to be near)
        record["data_distance"] = distance / n
    return record
