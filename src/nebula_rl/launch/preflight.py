"""What `nebula-rl check` finds without running anything (no torch, no download).

A config that validates can still not run: a local path that does not exist, a name that is
neither a path nor a Hub id, parallel sizes that do not fit the model or the job's batch, more
devices than the machine has. :func:`preflight` lists those problems (errors) and what the user
should know (notes: values that differ from what the config says, the device count the layout
needs). It reads only the config and the local files it names (a local model's config.json).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nebula_rl.config import Config, DatasetConfig, GrpoConfig
from nebula_rl.data.shards import is_shards, shard_urls
from nebula_rl.modality import for_config
from nebula_rl.utils.hub import is_hub_id

__all__ = ["Preflight", "preflight"]


@dataclass
class Preflight:
    """The outcome of :func:`preflight`."""

    errors: list[str] = field(default_factory=list)
    """What stops the job from running, each naming its key."""
    notes: list[str] = field(default_factory=list)
    """What the user should know."""


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
    ds: DatasetConfig, key: str, errors: list[str], *, fetched: frozenset[str] = frozenset()
) -> None:
    if ds.name in fetched:
        return  # (a set the modality fetches at launch, e.g. cosmos-rl's prompt sets)
    if ds.media_dir and not Path(ds.media_dir).is_dir():
        errors.append(f"{key}.media_dir: {ds.media_dir} is not a folder")
    if ds.local_dir:
        if not Path(ds.local_dir).exists():
            errors.append(f"{key}.local_dir: {ds.local_dir} does not exist")
        return
    if ds.name.startswith("s3://"):
        return  # (WebDataset shards in object storage: asked for when the job starts)
    if is_shards(ds.name):
        try:
            missing = [u for u in shard_urls(ds.name, key=f"{key}.name") if not Path(u).is_file()]
        except ValueError as err:
            errors.append(str(err))
            return
        if missing:
            errors.append(f"{key}.name: shard {missing[0]} does not exist")
        return
    _check_name(ds.name, f"{key}.name", errors, allow_builtin=True)


def preflight(
    cfg: Config, *, num_policy: int | None = None, num_rollout: int | None = None
) -> Preflight:
    """Check `cfg` against this machine without running it (see the module docstring)."""
    p = Preflight()
    num_policy = num_policy or cfg.policy.parallelism.n_init_replicas
    num_rollout = num_rollout or cfg.rollout.parallelism.n_init_replicas
    modality = for_config(cfg)
    if cfg.mode == "colocated":
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
    fetched = modality.fetched_datasets()
    train_set = cfg.train.train_policy.dataset
    _check_dataset(train_set, "train.train_policy.dataset", p.errors, fetched=fetched)
    if cfg.validation.enable and cfg.validation.dataset.name:
        _check_dataset(cfg.validation.dataset, "validation.dataset", p.errors, fetched=fetched)
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
    modality.check_layout(cfg, p, num_policy=num_policy, num_rollout=num_rollout)
    return p
