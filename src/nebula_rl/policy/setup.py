"""Preparing the policy's model for training: what the single-process loop (`local.py`) and the
policy replicas (`policy/worker.py`) both do before they build a `PolicyTrainer`.

1. `load_policy_model`: the weights in `train.master_dtype` (the copy the optimiser updates;
   forward and backward run in `train.param_dtype`, see `compute_dtype`), with `policy.lora`'s
   adapter injected (`nebula_rl.models.lora`), then `[policy]`'s trainable flags
   (`apply_trainable`).
2. The caller takes the copies that must stay plain now: the reference policy, and the local
   rollout engine's copy in `param_dtype` (`rollout_copy`: a LoRA policy's merged, under the
   plain names; `rollout_weights` gives the weights to load into it after each step). Weight
   pushes to rollout replicas send `pushed_weights` (a LoRA policy's adapter, which the
   rollouts merge).
3. `parallelize_policy`: FP8 linear layers first (`train.fp8`, `apply_fp8`); then, under
   torch.distributed with several ranks, the split of `[policy.parallelism]` (`parallelize.parallelize_model`, with every `[train]` and `[policy]`
   key it honours) and this rank's data-parallel place; in one process,
   `prepare_single_process`: activation checkpointing and torch.compile of the decoder blocks.
   The reference policy is split the same way (`parallelize_reference`).

`use_deterministic` switches torch to deterministic kernels for `train.deterministic`.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from nebula_rl.config import Config, PolicyConfig, TrainingConfig
from nebula_rl.models import check_fp8_gpu, load_model, resolve_dtype
from nebula_rl.models.lora import (
    adapter_parameters,
    apply_lora,
    has_lora,
    merged_parameters,
    plain_copy,
)

if TYPE_CHECKING:
    from nebula_rl.policy.parallelize import ParallelDims, ParallelModel
    from nebula_rl.policy.replicas import DataParallelSums
    from nebula_rl.weights.transport import NamedTensors

__all__ = [
    "PolicyParallel",
    "apply_fp8",
    "apply_trainable",
    "check_pipeline_micro_batches",
    "compute_dtype",
    "convert_fp8",
    "load_policy_model",
    "parallelize_policy",
    "parallelize_reference",
    "prepare_single_process",
    "pushed_weights",
    "rollout_copy",
    "rollout_weights",
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
    """The policy in `train.master_dtype` on `device`, with `policy.lora`'s adapter and
    `[policy]`'s trainable flags."""
    compute_dtype(cfg.train, sharded=False)  # refuse a bad pair before loading
    model = load_model(
        cfg.policy.model_name_or_path,
        dtype=resolve_dtype(cfg.train.master_dtype),
        device=device,
        seed=seed,
        revision=cfg.policy.model_revision,
    )
    if cfg.policy.lora is not None:
        apply_lora(model, cfg.policy)
    apply_trainable(model, cfg.policy)
    return model


def rollout_copy(model: nn.Module, train: TrainingConfig) -> nn.Module:
    """A copy of `model` in `train.param_dtype`, for a rollout engine in this process (rollout
    engines generate in the compute dtype); of a LoRA policy, the merged model, without peft."""
    plain = plain_copy(model) if has_lora(model) else copy.deepcopy(model)
    return plain.to(resolve_dtype(train.param_dtype))


def rollout_weights(model: nn.Module) -> NamedTensors:
    """The weights of the policy `model` (this rank's shards) as a rollout engine holds them:
    its parameters, or a LoRA policy's merged weights under the plain names. For an engine in
    this process, which copies them in place (`--local`, colocated replicas); pushes to rollout
    replicas send `pushed_weights`."""
    return merged_parameters(model) if has_lora(model) else model.named_parameters()


def pushed_weights(model: nn.Module) -> NamedTensors:
    """What a weight push sends from the policy `model` (this rank's shards) to the rollout
    replicas: its parameters, or a LoRA policy's adapter and the rest under the plain names
    (`adapter_parameters`), which each rollout rank merges into its weights
    (`nebula_rl.rollout.lora_merge`)."""
    return adapter_parameters(model) if has_lora(model) else model.named_parameters()


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


def _fp8_eligible(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The linear layers FP8 training converts: those of the decoder (feature sizes divisible
    by 16, as FP8 matmuls need), not the LM head, whose logits stay in the compute dtype."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or module is head:
            return False
        return all(size % 16 == 0 for size in module.weight.shape)

    return eligible


def apply_fp8(model: nn.Module, train: TrainingConfig) -> None:
    """With `train.fp8.enable_fp8`, swap the decoder's linear layers for torchao's Float8Linear
    in place (`quant_recipe`: row-wise or tensor-wise dynamic scales): forward and backward
    matmuls run in float8 on GPUs with FP8 units; the parameters stay as they are (same names,
    the master dtype), so checkpoints, exports and weight pushes do not change. Refused, naming
    the key, without such a GPU or without torchao."""
    fp8 = train.fp8
    if not fp8.enable_fp8:
        return
    key = "train.fp8.enable_fp8 = true"
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(
            f"{key} needs CUDA GPUs with FP8 matrix units (compute capability 8.9 or later: Ada, "
            f"Hopper, Blackwell); the policy is on {device.type}"
        )
    check_fp8_gpu(device, key)
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"{key} trains through torchao's float8 layers: pip install 'nebula-rl[fp8]' "
            f"(torchao) ({err})"
        ) from None
    convert_fp8(model, fp8.quant_recipe)


def convert_fp8(model: nn.Module, recipe: str) -> None:
    """Swap `model`'s decoder linear layers for torchao's Float8Linear with the scale `recipe`
    (`rowwise`, `tensorwise`), in place (what `apply_fp8` does once it checked the device)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=_fp8_eligible(model))


def prepare_single_process(model: nn.Module, cfg: Config) -> None:
    """In place, for a model trained whole in this process: activation checkpointing
    (`policy.model_gradient_checkpointing`) and torch.compile (`train.compile`) of each decoder
    block, as `parallelize_model` applies them on a mesh; FP8 linear layers first
    (`train.fp8`, `apply_fp8`)."""
    from nebula_rl.policy.parallelize import apply_ac, apply_compile

    if cfg.train.fsdp_offload:
        raise ValueError(
            "train.fsdp_offload needs FSDP2 (policy.parallelism.dp_shard_size > 1 on several "
            "GPUs); this model is trained whole in one process"
        )
    apply_fp8(model, cfg.train)
    if cfg.policy.model_gradient_checkpointing:
        apply_ac(model)
    if cfg.train.compile:
        apply_compile(model)


@dataclass(frozen=True, slots=True)
class PolicyParallel:
    """A policy prepared for training on this rank: what `PolicyTrainer` takes, and this rank's
    place among the data-parallel ranks (which share of the batch it trains on)."""

    model: nn.Module | ParallelModel
    """The ParallelModel of this rank over the process group, or, in one process, the model."""
    dp_rank: int
    """This rank's data-parallel rank (TP, PP and CP ranks of one data-parallel rank share it)."""
    dp_size: int
    """Data-parallel ranks."""
    data_parallel: DataParallelSums | None
    """Sums over the data-parallel ranks (None with one)."""


def _param_dtype(train: TrainingConfig) -> torch.dtype | None:
    """The compute dtype FSDP2 casts the parameters to (or forward passes autocast to); None
    when it is the master copy's own."""
    return None if train.param_dtype == train.master_dtype else resolve_dtype(train.param_dtype)


def check_pipeline_micro_batches(cfg: Config, dims: ParallelDims) -> None:
    """Refuse, naming the keys, a full forward pass of `mini_batch` rows that the pipeline
    schedule could not run as `pp_micro_batch_size`-row micro-batches (smaller passes, the
    remainder of a batch or of a data-parallel share, are padded, see `ParallelModel`)."""
    par = cfg.policy.parallelism
    p = cfg.train.train_policy
    if dims.pp == 1 or getattr(p, "max_token_len_per_mini_batch", None) is not None:
        return
    rows, size = p.mini_batch, par.pp_micro_batch_size
    keys = "train.train_policy.mini_batch and policy.parallelism.pp_micro_batch_size"
    if rows % size:
        raise ValueError(
            f"{keys}: pp_micro_batch_size ({size}) must divide mini_batch ({rows}), the rows "
            "of a forward pass"
        )
    n = rows // size
    if par.pp_schedule == "1F1B" and n < dims.pp:
        raise ValueError(
            f"{keys}: pp_schedule = '1F1B' needs at least pp_size ({dims.pp}) micro-batches "
            f"per forward pass; mini_batch / pp_micro_batch_size = {n}"
        )
    if par.pp_schedule == "Interleaved1F1B" and n % max(1, n // dims.pp):
        raise ValueError(
            f"{keys}: pp_schedule = 'Interleaved1F1B' runs micro-batches in rounds of pp_size "
            f"({dims.pp}): mini_batch / pp_micro_batch_size = {n} must be a multiple of "
            f"{max(1, n // dims.pp)}"
        )


def parallelize_policy(model: nn.Module, cfg: Config) -> PolicyParallel:
    """Prepare the policy `model` (loaded on every rank alike) for training on this rank.

    Under torch.distributed with several ranks: the mesh of `[policy.parallelism]` over the
    default process group (on CUDA when available), and the model split over it in place
    (`parallelize_model`: PP with `pp_schedule`, `pp_layers_per_stage` and
    `pp_micro_batch_size`, TP, activation checkpointing (`policy.model_gradient_checkpointing`),
    torch.compile (`train.compile`), FSDP2/HSDP/DDP with `train.param_dtype`,
    `fsdp_reduce_dtype`, `fsdp_reshard_after_forward` and `fsdp_offload`); the model is
    consumed under PP (use `PolicyParallel.model`). In one process: `prepare_single_process`.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        prepare_single_process(model, cfg)
        return PolicyParallel(model, 0, 1, None)
    from nebula_rl.policy.parallelize import ParallelDims, parallelize_model
    from nebula_rl.policy.replicas import DataParallelSums

    par, t = cfg.policy.parallelism, cfg.train
    dims = ParallelDims.from_config(par, world_size=dist.get_world_size())
    check_pipeline_micro_batches(cfg, dims)
    apply_fp8(model, cfg.train)  # (before FSDP2 and compile wrap the linear layers)
    mesh = dims.build_mesh("cuda" if torch.cuda.is_available() else "cpu")
    parallel = parallelize_model(
        model,
        dims,
        mesh,
        pp_micro_batch_size=par.pp_micro_batch_size,
        pp_schedule=par.pp_schedule,
        pp_layers_per_stage=par.pp_layers_per_stage,
        activation_checkpointing=cfg.policy.model_gradient_checkpointing,
        compile=t.compile,
        param_dtype=_param_dtype(t),
        reduce_dtype=resolve_dtype(t.fsdp_reduce_dtype),
        reshard_after_forward=t.fsdp_reshard_after_forward,
        offload=t.fsdp_offload,
    )
    sums = DataParallelSums(mesh["dp"].get_group()) if dims.dp > 1 else None
    return PolicyParallel(parallel, parallel.dp_rank, dims.dp, sums)


def parallelize_reference(
    ref: nn.Module, policy: PolicyParallel, cfg: Config
) -> nn.Module | ParallelModel:
    """The reference policy `ref` (a copy of the policy taken before `parallelize_policy`),
    frozen, and split like `policy` on the same mesh (forward only: no activation
    checkpointing or compile; FSDP2 frees the gathered parameters after every forward)."""
    from nebula_rl.policy.parallelize import ParallelModel, parallelize_model

    ref.eval().requires_grad_(False)
    parallel = policy.model
    if not isinstance(parallel, ParallelModel):
        return ref
    t = cfg.train
    return parallelize_model(
        ref,
        parallel.dims,
        parallel.mesh,
        pp_micro_batch_size=parallel.pp_micro_batch_size,
        pp_schedule=parallel.pp_schedule,
        pp_layers_per_stage=cfg.policy.parallelism.pp_layers_per_stage,
        param_dtype=_param_dtype(t),
        reduce_dtype=resolve_dtype(t.fsdp_reduce_dtype),
        reshard_after_forward="always",
        offload=t.fsdp_offload,
    )


def use_deterministic(train: TrainingConfig) -> None:
    """With `train.deterministic`, make torch use deterministic kernels (error on ops that
    have none); cuBLAS then needs a fixed workspace, set unless the environment sets one."""
    if not train.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
