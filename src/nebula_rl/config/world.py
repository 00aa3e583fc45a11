"""The world-model part of the tree: the keys a world-model run (`policy.is_diffusers`) reads,
and why it refuses the others.
"""

from __future__ import annotations

import json
from typing import Any

from nebula_rl.config.algorithm import GrpoConfig, SftConfig
from nebula_rl.config.job import Config
from nebula_rl.config.keys import (
    format_value,
    section_default,
    value_at,
    within_default_mapping,
)
from nebula_rl.config.policy import DiffusersConfig, primary_adapter_refusals

FLOW_RL_TRAINERS = {"flow_grpo": "flow_grpo", "ddrl": "ddrl", "diffusion_nft": "nft"}
"""World-model RL trainers (`train.train_policy.trainer_type`) -> `FlowRLSettings.algorithm`."""
FLOW_KEYS = (
    "train.epoch", "train.output_dir", "train.timestamp", "train.seed", "train.max_num_steps",
    "train.train_batch_per_replica", "train.optm_name", "train.optm_impl", "train.optm_lr",
    "train.optm_betas", "train.epsilon", "train.optm_weight_decay", "train.optm_warmup_steps",
    "train.optm_warmup_start_factor", "train.optm_decay_ratio", "train.optm_decay_type",
    "train.optm_min_lr_factor", "train.optm_grad_norm_clip",
    "train.train_policy.type", "train.train_policy.trainer_type", "train.train_policy.dataset.name",
    "train.train_policy.dataset.kwargs", "train.train_policy.dataset.split",
    "train.train_policy.dataset.local_dir",
    "train.train_policy.mini_batch",
    "train.train_policy.reward_function", "train.train_policy.use_remote_reward",
    "train.train_policy.remote_reward", "train.train_policy.kl_beta",
    "train.train_policy.epsilon_low", "train.train_policy.epsilon_high",
    "train.train_policy.data_beta", "train.train_policy.exp_reward",
    "train.train_policy.reference_reset_interval",
    "train.train_policy.reset_optimizer_with_reference",
    "policy.model_name_or_path", "policy.model_revision", "policy.is_diffusers",
    "policy.model_gradient_checkpointing",
    "policy.warmstart_config",
    "policy.lora.r", "policy.lora.lora_alpha", "policy.lora.lora_dropout",
    "policy.lora.target_modules", "policy.lora.use_rslora", "policy.lora.modules_to_save",
    "policy.lora.alpha_pattern", "policy.lora.r_pattern", "policy.lora.init_lora_weights",
    "policy.lora.lora_names", "policy.lora.lora_path", "policy.lora.primary_adapter",
    "policy.diffusers.is_video", "policy.diffusers.inference_size",
    "policy.diffusers.inference_frames", "policy.diffusers.train_frames",
    "policy.diffusers.timesteps_fraction", "policy.diffusers.train_on",
    "policy.diffusers.nft_beta", "policy.diffusers.nft_old_update", "policy.diffusers.ratio_form",
    "policy.diffusers.kl_form", "policy.diffusers.detach_unconditional",
    "policy.diffusers.min_num_conditional_frames", "policy.diffusers.max_num_conditional_frames",
    "policy.diffusers.weight_copy_decay_type", "policy.diffusers.train_flow_shift",
    "policy.diffusers.weighting_scheme", "policy.diffusers.logit_mean",
    "policy.diffusers.logit_std", "policy.diffusers.max_prompt_length", "policy.diffusers.offload",
    "policy.diffusers.sample.num_steps", "policy.diffusers.sample.eval_num_steps",
    "policy.diffusers.sample.guidance_scale", "policy.diffusers.sample.global_std",
    "policy.diffusers.sample.noise_level", "policy.diffusers.sample.deterministic_sampling",
    "policy.diffusers.sample.solver", "policy.diffusers.sample.same_group_noise",
    "policy.diffusers.sample.population_std",
    "policy.diffusers.tokenizer.compile_encode",
    "rollout.n_generation",
    # (the runtime's: replicas, the controller, the staleness bound, weight pushes)
    "rollout.batch_size", "rollout.seed", "rollout.parallelism.n_init_replicas",
    "policy.parallelism.n_init_replicas", "policy.parallelism.dp_shard_size",
    "policy.parallelism.dp_replicate_size", "policy.parallelism.cp_size",
    "train.sync_weight_interval", "train.transfer_dtype",
    "train.train_policy.allowed_outdated_steps", "controller", "redis",
    # (colocated mode: the policy's ranks sample and train)
    "mode", "train.train_policy.uncentralized_training", "rollout.parallelism.dp_shard_size",
    # (`nebula_rl.flow.validation`)
    "validation.enable", "validation.val_before_train", "validation.freq",
    "validation.dataset.name", "validation.dataset.kwargs", "validation.dataset.split",
    "validation.dataset.local_dir", "validation.n_generation",
    "validation.batch_size", "validation.max_num_prompts", "validation.reward_function",
    # (a world model's completions are tensors, sampled by its own sampler)
    "train.non_text", "rollout.backend",
    "train.ema_enable", "train.ema_decay", "train.ema_update_step_interval",
    "train.param_dtype", "train.ckpt", "train.resume",
    "logging.logger", "logging.log_interval", "logging.multi_modal_log_interval",
    "logging.project_name", "logging.group_name", "logging.experiment_name", "logging.wandb_mode",
)  # fmt: skip
"""The keys a world-model run (`policy.is_diffusers`) reads (a dotted prefix covers its
subkeys); any other key it is given is refused, naming it."""


def world_refusals(cfg: Config, user_keys: dict[str, Any]) -> list[str]:
    """Why a world-model config cannot run: keys it does not read, and rules between keys."""
    return _unread_keys(cfg, user_keys) + _rules(cfg, user_keys)


def _unread_keys(cfg: Config, user_keys: dict[str, Any]) -> list[str]:
    """The keys the user set, at other values than their defaults, that a world-model run does
    not read (`FLOW_KEYS`)."""
    out = []
    for key in sorted(user_keys):
        if any(key == k or key.startswith(k + ".") for k in FLOW_KEYS):
            continue
        if key.startswith("validation.") and not cfg.validation.enable:
            continue  # (read by nothing while validation is off)
        found, value, default, refusal = value_at(cfg, key)
        if found and (value == default or value == section_default(cfg, key)):
            continue  # (a key written at its default asks for nothing)
        if not found and within_default_mapping(cfg, key):
            continue  # (an entry of a mapping at its default, e.g. `dataset.media_settings`)
        # (a refused section that world models read in part, e.g. policy.lora: its other keys)
        parent = key.rsplit(".", 1)[0]
        partly_read = value_at(cfg, parent)[3] is not None and any(
            k.startswith(parent + ".") for k in FLOW_KEYS
        )
        why = (
            refusal["refused"]
            if refusal and not partly_read
            else "does not apply to world-model runs yet"
        )
        shown = f" = {format_value(value)}" if found else ""
        out.append(f"{key}{shown}: {why}")
    return out


def _rules(cfg: Config, user_keys: dict[str, Any]) -> list[str]:
    """The rules between a world-model run's keys."""
    out: list[str] = []
    p = cfg.train.train_policy
    d = cfg.policy.diffusers
    sft = isinstance(p, SftConfig)
    if sft and p.trainer_type not in ("sft", "diffusers_sft"):
        out.append(
            f"train.train_policy.trainer_type = {json.dumps(p.trainer_type)}: a world model's "
            'SFT is "sft" or "diffusers_sft" (world-model training)'
        )
    if not sft and p.trainer_type not in FLOW_RL_TRAINERS:
        out.append(
            f"train.train_policy.trainer_type = {json.dumps(p.trainer_type)}: world-model RL "
            f"trains with {', '.join(map(json.dumps, FLOW_RL_TRAINERS))}"
        )
    if cfg.policy.lora is not None:
        out += primary_adapter_refusals(cfg.policy.lora)
    if isinstance(p, GrpoConfig):
        if (p.trainer_type == "ddrl") != (p.data_beta > 0):
            out.append(
                f"train.train_policy.data_beta = {p.data_beta}: world-model DDRL "
                '(trainer_type = "ddrl"), and only DDRL, needs it > 0'
            )
        if cfg.rollout.n_generation < 2 and p.trainer_type in FLOW_RL_TRAINERS:
            out.append(
                f"rollout.n_generation = {cfg.rollout.n_generation}: world-model RL's "
                "advantages are group-relative, and a group of one sample has advantage 0 (its "
                "reward less its own mean), so nothing would train; sample at least 2 per prompt"
            )
        if p.trainer_type != "diffusion_nft" and d.sample.deterministic_sampling:
            out.append(
                "policy.diffusers.sample.deterministic_sampling = true: world-model FlowGRPO and "
                "DDRL need the SDE's log-probabilities; only diffusion_nft samples "
                "deterministically"
            )
        if d.train_on is not None:
            out += _train_on_refusals(d)
        if p.reference_reset_interval and p.kl_beta == 0:
            out.append(
                f"train.train_policy.reference_reset_interval = {p.reference_reset_interval}: "
                "resets the KL reference, which a world-model run has only with kl_beta > 0"
            )
        if p.use_remote_reward and "train.train_policy.reward_function" in user_keys:
            out.append(
                "train.train_policy.reward_function: a world-model run with use_remote_reward "
                "takes its rewards from remote_reward.reward_fns; give one or the other"
            )
    if d.min_num_conditional_frames > d.max_num_conditional_frames:
        out.append(
            f"policy.diffusers.min_num_conditional_frames ({d.min_num_conditional_frames}) "
            f"must not exceed max_num_conditional_frames ({d.max_num_conditional_frames})"
        )
    if d.weighting_scheme not in ("uniform", "logit_normal"):
        out.append(
            f"policy.diffusers.weighting_scheme = {json.dumps(d.weighting_scheme)}: "
            'world-model SFT samples noise levels "uniform" or "logit_normal"'
        )
    solver = d.sample.solver
    if solver not in ("euler", "dpm2"):
        out.append(
            f"policy.diffusers.sample.solver = {json.dumps(solver)}: world-model rollouts take "
            '"euler" (the SDE, or its ODE with deterministic_sampling) or "dpm2"'
        )
    elif solver == "dpm2" and not d.sample.deterministic_sampling:
        out.append(
            'policy.diffusers.sample.solver = "dpm2" solves the ODE: it needs '
            "policy.diffusers.sample.deterministic_sampling = true (DiffusionNFT)"
        )
    if "rollout.backend" in user_keys and cfg.rollout.backend not in (
        "vllm",  # (the default: not a choice)
        "diffusion_nft_rollout",
    ):
        out.append(
            f"rollout.backend = {json.dumps(cfg.rollout.backend)}: a world model samples with "
            "nebula-rl's flow sampler (cosmos-rl's name for it: \"diffusion_nft_rollout\")"
        )
    colocated = cfg.mode == "colocated"
    if cfg.mode == "colocated_separated":
        out.append(
            'mode = "colocated_separated": world models run "disaggregated" (rollout and '
            'policy replicas) or "colocated" (the policy\'s ranks sample and train)'
        )
    if isinstance(p, GrpoConfig) and p.uncentralized_training and not colocated:
        out.append(
            'train.train_policy.uncentralized_training = true: needs mode = "colocated" '
            "(rollouts go straight to the local policy)"
        )
    shards = cfg.rollout.parallelism.dp_shard_size
    if shards != 1 and not (colocated and shards == cfg.policy.parallelism.dp_shard_size):
        out.append(
            f"rollout.parallelism.dp_shard_size = {shards}: a world model's rollouts are "
            'sharded only in mode = "colocated", where they run on the policy\'s ranks (equal '
            f"to policy.parallelism.dp_shard_size, {cfg.policy.parallelism.dp_shard_size})"
        )
    return out


def _train_on_refusals(d: DiffusersConfig) -> list[str]:
    """Why `policy.diffusers.train_on` cannot pick those steps."""
    steps, picks = d.sample.num_steps, d.train_on or []
    named = [i for i in picks if i != -1]
    key = f"policy.diffusers.train_on = {format_value(picks)}"
    if not picks:
        return [f"{key}: name at least one step (or leave it unset)"]
    if any(not 0 <= i < steps for i in named) or len(set(named)) != len(named):
        return [
            f"{key}: each entry is -1 or a distinct step index below "
            f"policy.diffusers.sample.num_steps ({steps})"
        ]
    if len(picks) > steps:
        return [f"{key}: more steps than a rollout has (sample.num_steps = {steps})"]
    if d.timesteps_fraction != 1.0:
        return [
            f"{key}: policy.diffusers.timesteps_fraction = {d.timesteps_fraction} picks the "
            "steps too; give one or the other"
        ]
    return []
