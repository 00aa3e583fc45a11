"""What `nebula-rl check` finds without running anything (no torch, no download).

A config that validates can still not run: a local path that does not exist, a name that is
neither a path nor a Hub id, parallel sizes that do not fit the model or the job's batch, more
devices than the machine has. :func:`preflight` lists those problems (errors) and what the user
should know (notes: values that differ from what the config says, the device count the layout
needs). It reads only the config and the local files it names (a local model's config.json).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_rl.config import Config, DatasetConfig, GrpoConfig, ParallelismConfig
from nebula_rl.utils.hub import is_hub_id

__all__ = ["Preflight", "preflight", "replica_world_size", "visible_gpus"]


@dataclass
class Preflight:
    """The outcome of :func:`preflight`."""

    errors: list[str] = field(default_factory=list)
    """What stops the job from running, each naming its key."""
    notes: list[str] = field(default_factory=list)
    """What the user should know."""


def replica_world_size(par: ParallelismConfig) -> int | None:
    """Processes (devices) of one replica; None when `dp_shard_size = -1` leaves it open."""
    if par.dp_shard_size == -1:
        return None
    return par.pp_size * par.dp_replicate_size * par.dp_shard_size * par.cp_size * par.tp_size


def _check_name(name: str, key: str, errors: list[str], *, allow_builtin: bool = False) -> None:
    """A name must be an existing path, a Hub id, a preset (`tiny:`) or a builtin task."""
    if not name or Path(name).exists() or is_hub_id(name):
        return
    if name.startswith("tiny:") or (allow_builtin and name.startswith("builtin:")):
        return
    errors.append(
        f"{key}: {name!r} is neither an existing local path nor a Hugging Face Hub id (owner/name)"
    )


def _check_dataset(
    ds: DatasetConfig, key: str, errors: list[str], *, world_model: bool = False
) -> None:
    if world_model:
        from nebula_rl.flow.prompts import PROMPT_SETS

        if ds.name in PROMPT_SETS:
            return  # (cosmos-rl's prompt sets: fetched at launch, `flow.prompts`)
    if ds.media_dir and not Path(ds.media_dir).is_dir():
        errors.append(f"{key}.media_dir: {ds.media_dir} is not a folder")
    if ds.local_dir:
        if not Path(ds.local_dir).exists():
            errors.append(f"{key}.local_dir: {ds.local_dir} does not exist")
        return
    _check_name(ds.name, f"{key}.name", errors, allow_builtin=True)


def _local_model_config(cfg: Config) -> dict[str, Any] | None:
    """The config.json of a local model folder (None for presets, Hub ids, missing folders)."""
    path = Path(cfg.policy.model_name_or_path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data.get("text_config", data) if isinstance(data, dict) else None


def visible_gpus() -> int | None:
    """CUDA devices this machine shows (CUDA_VISIBLE_DEVICES, else nvidia-smi); None if unknown
    or none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()]) or None
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(line.startswith("GPU ") for line in out.splitlines()) or None


def _layout(cfg: Config, num_policy: int, num_rollout: int, p: Preflight) -> None:
    policy, rollout = cfg.policy.parallelism, cfg.rollout.parallelism
    rl = isinstance(cfg.train.train_policy, GrpoConfig)
    policy_world = replica_world_size(policy)
    rollout_world = replica_world_size(rollout) if rl else 0
    model = _local_model_config(cfg)
    if model is not None:
        for size_key, size in (("tp_size", policy.tp_size), ("tp_size", rollout.tp_size)):
            for dim in ("num_attention_heads", "num_key_value_heads"):
                count = model.get(dim)
                if isinstance(count, int) and size > 1 and count % size:
                    which = "policy" if size == policy.tp_size else "rollout"
                    p.errors.append(
                        f"{which}.parallelism.{size_key} ({size}) must divide the model's {dim} "
                        f"({count})"
                    )
    if policy_world is not None:
        dp = policy.dp_replicate_size * policy.dp_shard_size
        samples = cfg.groups_per_replica * cfg.rollout.n_generation if rl else 1
        if rl and samples < dp:
            p.errors.append(
                f"train.train_batch_per_replica ({cfg.train.train_batch_per_replica}) gives "
                f"{samples} completions per policy replica, fewer than its {dp} data-parallel "
                "ranks: every rank needs at least one"
            )
    if policy_world is None:
        p.notes.append(
            "policy.parallelism.dp_shard_size = -1: each policy replica takes the devices the "
            "launcher gives it"
        )
        return
    # (mode = "colocated_separated": the rollout replicas run on the policy replicas' GPUs)
    shared = rl and cfg.mode == "colocated_separated"
    rollout_ranks = rollout_world or 0
    need = num_policy * policy_world + (0 if shared else num_rollout * rollout_ranks)
    parts = f"policy {num_policy} x {policy_world}"
    if rl and cfg.mode == "colocated":  # (no rollout replicas: num_rollout is 0)
        parts += ", every rank also generating: colocated"
    elif rl:
        parts += f" + rollout {num_rollout} x {rollout_world}"
    if rl and cfg.distillation.enable:
        teacher = cfg.distillation.parallelism
        num_teacher = teacher.n_init_replicas
        need += num_teacher
        parts += f" + teacher {num_teacher} x 1"
        if replica_world_size(teacher) != 1:
            p.notes.append(
                "distillation.parallelism: each teacher replica runs whole in one process "
                "(a split teacher is not built yet: `nebula-rl train` refuses sizes above 1; "
                "scale the teacher with n_init_replicas)"
            )
    if shared:
        p.notes.append(
            f"layout: {need} device(s) ({parts}, the rollout replicas on the policy replicas' "
            f'GPUs: mode = "colocated_separated"), or {need + num_rollout * rollout_ranks} '
            "CPU processes"
        )
        if rollout_ranks > policy_world:
            p.errors.append(
                f'mode = "colocated_separated": a rollout replica (rollout.parallelism.tp_size '
                f"* pp_size = {rollout_ranks}) must fit in the GPUs of one policy replica "
                f"(policy.parallelism: {policy_world})"
            )
    else:
        p.notes.append(f"layout: {need} device(s) or CPU processes ({parts})")
    gpus = visible_gpus()
    if gpus is not None and need > gpus:
        p.errors.append(
            f"the layout needs {need} GPUs ({parts}: policy.parallelism, "
            f"rollout.parallelism, --policy/--rollout) and this machine shows {gpus}"
        )


def _flow_model(cfg: Config, p: Preflight) -> None:
    """A world model on disk or a preset is checked here (its class, its pixel space); a Hub
    model's configs are fetched and checked at launch."""
    from nebula_rl.flow.diffusers_models import DIFFUSERS_CLASSES
    from nebula_rl.flow.models import check_flow_model
    from nebula_rl.flow.vae import VAE_CLASSES

    name = cfg.policy.model_name_or_path
    if Path(name).exists() or name.startswith("tiny:"):
        try:
            check_flow_model(cfg)
        except ValueError as err:
            p.errors.append(str(err))
    elif is_hub_id(name):
        p.notes.append(
            f"policy.model_name_or_path: {name} is fetched from the Hub at launch; its "
            f"transformer must be a {' / '.join(DIFFUSERS_CLASSES)}, in pixel space "
            f"(in_channels = 3) or with its pipeline's {' / '.join(VAE_CLASSES)} in vae/"
        )


def preflight(
    cfg: Config, *, num_policy: int | None = None, num_rollout: int | None = None
) -> Preflight:
    """Check `cfg` against this machine without running it (see the module docstring)."""
    p = Preflight()
    num_policy = num_policy or cfg.policy.parallelism.n_init_replicas
    num_rollout = num_rollout or cfg.rollout.parallelism.n_init_replicas
    if cfg.mode == "colocated" and not cfg.policy.is_diffusers:
        num_rollout = 0  # (the policy replicas generate)
    policy = cfg.policy
    if policy.warmstart_config is not None:
        if not Path(policy.warmstart_config).is_file():
            p.errors.append(f"policy.warmstart_config: {policy.warmstart_config} does not exist")
    else:
        _check_name(policy.model_name_or_path, "policy.model_name_or_path", p.errors)
    if cfg.distillation.enable:
        name = cfg.distillation.model_name_or_path
        _check_name(name, "distillation.model_name_or_path", p.errors)
    if policy.model_safetensor_path and not Path(policy.model_safetensor_path).exists():
        p.errors.append(
            f"policy.model_safetensor_path: {policy.model_safetensor_path} does not exist"
        )
    flow = policy.is_diffusers
    train_set = cfg.train.train_policy.dataset
    _check_dataset(train_set, "train.train_policy.dataset", p.errors, world_model=flow)
    if cfg.validation.enable and cfg.validation.dataset.name:
        _check_dataset(cfg.validation.dataset, "validation.dataset", p.errors, world_model=flow)
    rl = cfg.train.train_policy
    if isinstance(rl, GrpoConfig):
        sampled_at = cfg.rollout.sampling_config.temperature
        if rl.temperature != sampled_at:
            p.notes.append(
                f"train.train_policy.temperature ({rl.temperature}) differs from "
                f"rollout.sampling_config.temperature ({sampled_at}): the policy's log-probs are "
                f"taken at {rl.temperature} while the rollouts sample at {sampled_at} (as in "
                "cosmos-rl); the ratio is taken against log-probs the policy recomputes"
            )
        if cfg.train.train_batch_per_replica % cfg.rollout.n_generation:
            p.notes.append(
                f"train.train_batch_per_replica ({cfg.train.train_batch_per_replica}) is not a "
                f"multiple of rollout.n_generation ({cfg.rollout.n_generation}): each step "
                f"trains {cfg.groups_per_replica} whole group(s) per policy replica "
                f"({cfg.groups_per_replica * cfg.rollout.n_generation} completions)"
            )
    if cfg.policy.is_diffusers:
        _flow_model(cfg, p)
        par = cfg.policy.parallelism
        shards = par.dp_shard_size * par.dp_replicate_size
        split = (
            f"HSDP: {par.dp_replicate_size} copies of {par.dp_shard_size} shard(s)"
            if par.dp_replicate_size > 1
            else "FSDP2-sharded"
        )
        if cfg.mode == "colocated" or not isinstance(rl, GrpoConfig):
            p.notes.append(
                f"layout: the world model trains on {shards} rank(s), {split}"
                + (", sampling its own rollouts (colocated)" if isinstance(rl, GrpoConfig) else "")
                + " (docs/world-models.md)"
            )
        else:
            p.notes.append(
                f"layout: world-model RL runs {num_policy} policy replica(s) of {shards} "
                f"process(es) ({split}) and {num_rollout} rollout replica(s) of one (`--local`: all in "
                "this one process; docs/world-models.md)"
            )
        return p
    _layout(cfg, num_policy, num_rollout, p)
    return p
