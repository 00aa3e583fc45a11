"""Preparing the policy's model for training: what the single-process loop (`local.py`) and the
policy replicas (`policy/worker.py`) both do before they build a `PolicyTrainer`.

1. `load_policy_model`: the weights in `train.master_dtype` (the copy the optimiser updates;
   forward and backward run in `train.param_dtype`, see `compute_dtype`), then `[policy]`'s
   trainable flags (`apply_trainable`).
2. The caller takes the copies that must stay plain now: the reference policy, and the local
   rollout engine's copy in `param_dtype` (`rollout_copy`).
3. `prepare_single_process`: activation checkpointing and torch.compile of the decoder blocks,
   which `parallelize.parallelize_model` applies instead when the model is split over a mesh.

`use_deterministic` switches torch to deterministic kernels for `train.deterministic`.
"""

from __future__ import annotations

import copy
import os
import re

import torch
from torch import nn

from nebula_rl.config import Config, PolicyConfig, TrainingConfig
from nebula_rl.models import load_model, resolve_dtype

__all__ = [
    "apply_trainable",
    "compute_dtype",
    "load_policy_model",
    "prepare_single_process",
    "rollout_copy",
    "use_deterministic",
]


def compute_dtype(train: TrainingConfig, *, sharded: bool) -> torch.dtype | None:
    """The dtype to autocast forward passes to: `train.param_dtype` when it differs from
    `train.master_dtype`, None when they are equal or FSDP2 casts the parameters itself
    (`sharded`). A compute dtype wider than the master copy is refused."""
    master, param = resolve_dtype(train.master_dtype), resolve_dtype(train.param_dtype)
    if param.itemsize > master.itemsize:
        raise ValueError(
            f"train.param_dtype ({train.param_dtype}) must not be wider than train.master_dtype "
            f"({train.master_dtype}): the master copy holds the weights at full precision"
        )
    return None if param == master or sharded else param


def load_policy_model(cfg: Config, *, device: torch.device | str, seed: int) -> nn.Module:
    """The policy in `train.master_dtype` on `device`, with `[policy]`'s trainable flags."""
    compute_dtype(cfg.train, sharded=False)  # refuse a bad pair before loading
    model = load_model(
        cfg.policy.model_name_or_path,
        dtype=resolve_dtype(cfg.train.master_dtype),
        device=device,
        seed=seed,
        revision=cfg.policy.model_revision,
    )
    apply_trainable(model, cfg.policy)
    return model


def rollout_copy(model: nn.Module, cfg: Config) -> nn.Module:
    """A copy of `model` in `train.param_dtype`, for a rollout engine in this process (rollout
    engines generate in the compute dtype)."""
    return copy.deepcopy(model).to(resolve_dtype(cfg.train.param_dtype))


def _compile_patterns(key: str, patterns: list[str]) -> list[re.Pattern[str]]:
    try:
        return [re.compile(p) for p in patterns]
    except re.error as err:
        raise ValueError(f"{key}: invalid regular expression {err.pattern!r}: {err}") from None


def _match(key: str, patterns: list[str], names: list[str]) -> set[str]:
    """Names matched (re.search) by any of `patterns`; ValueError for a pattern matching none."""
    compiled = _compile_patterns(key, patterns)
    hits = {p.pattern: [n for n in names if p.search(n)] for p in compiled}
    unmatched = [pattern for pattern, matched in hits.items() if not matched]
    if unmatched:
        raise ValueError(f"{key}: {unmatched} match no parameter name")
    return {n for matched in hits.values() for n in matched}


def apply_trainable(model: nn.Module, policy: PolicyConfig) -> None:
    """Set `requires_grad` from `policy.trainable_pattern` (only matching parameters train) or
    `policy.freeze_pattern` (matching parameters do not), then `policy.trainable_map` (exact
    parameter or module names -> flag, in order). Names that match nothing, and a model left
    with nothing to train, are ValueErrors naming the key."""
    params = dict(model.named_parameters(remove_duplicate=False))
    names = list(params)
    if policy.trainable_pattern is not None:
        matched = _match("policy.trainable_pattern", policy.trainable_pattern, names)
        for name, param in params.items():
            param.requires_grad_(name in matched)
    elif policy.freeze_pattern is not None:
        for name in _match("policy.freeze_pattern", policy.freeze_pattern, names):
            params[name].requires_grad_(False)
    modules = dict(model.named_modules())
    for name, flag in (policy.trainable_map or {}).items():
        if name in params:
            params[name].requires_grad_(flag)
        elif name and name in modules:
            modules[name].requires_grad_(flag)
        else:
            raise ValueError(
                f"policy.trainable_map: {name!r} is neither a parameter nor a module of the model"
            )
    if not any(p.requires_grad for p in params.values()):
        raise ValueError(
            "policy.trainable_pattern / freeze_pattern / trainable_map leave no parameter to train"
        )


def prepare_single_process(model: nn.Module, cfg: Config) -> None:
    """In place, for a model trained whole in this process: activation checkpointing
    (`policy.model_gradient_checkpointing`) and torch.compile (`train.compile`) of each decoder
    block, as `parallelize_model` applies them on a mesh."""
    from nebula_rl.policy.parallelize import apply_ac, apply_compile

    if cfg.train.fsdp_offload:
        raise ValueError(
            "train.fsdp_offload needs FSDP2 (policy.parallelism.dp_shard_size > 1 on several "
            "GPUs); this model is trained whole in one process"
        )
    if cfg.policy.model_gradient_checkpointing:
        apply_ac(model)
    if cfg.train.compile:
        apply_compile(model)


def use_deterministic(train: TrainingConfig) -> None:
    """With `train.deterministic`, make torch use deterministic kernels (error on ops that
    have none); cuBLAS then needs a fixed workspace, set unless the environment sets one."""
    if not train.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
