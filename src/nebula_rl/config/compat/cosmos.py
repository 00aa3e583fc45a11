"""cosmos-rl's behaviours that its configs rely on: side effects between keys (applied to the raw
tables before validation), the stale keys its shipped configs carry, and its trainer names.
"""

from __future__ import annotations

import logging
from typing import Any

from nebula_rl.config.algorithm import VARIANT_DEFAULTS
from nebula_rl.config.base import NO_VLA

log = logging.getLogger(__name__)


STALE_KEYS: dict[str, str] = {
    "policy.parallelism.cp_rotate_method": "removed from cosmos-rl's schema with its CP rewrite",
    "rollout.parallelism.cp_rotate_method": "removed from cosmos-rl's schema with its CP rewrite",
    "train.train_policy.clip_ratio_c": "not a cosmos-rl key (verl's name of lower_bound_ratio)",
    "vla.filter_lower_bound": "not a cosmos-rl key",
    "vla.filter_upper_bound": "not a cosmos-rl key",
    "policy.diffusers.timestep_fraction": "a misspelling of timesteps_fraction",
    "policy.model_gradient_checkpointig": "a misspelling of model_gradient_checkpointing",
    "distillation.model_max_length": "not a key of cosmos-rl's [distillation]",
    # Cosmos-Reason1's recipe configs (the Cosmos-Reason2 post-training recipe) predate
    # cosmos-rl's [validation] table, which replaced these; set [validation] instead.
    "train.enable_validation": "replaced by [validation] enable",
    "train.validation_step": "replaced by [validation] freq",
    "train.validation_batch_per_replica": "replaced by [validation] batch_size",
}
"""Keys that cosmos-rl's own shipped configs carry but no cosmos-rl code reads (it drops unknown
keys silently): accepted here with a warning that names them, and then ignored, as there."""


def infer_policy_type(policy: dict[str, Any]) -> None:
    """cosmos-rl configs may omit `train.train_policy.type`; infer it the same way."""
    if "type" in policy:
        return
    rl_keys = {"temperature", "epsilon_low", "epsilon_high", "kl_beta", "use_remote_reward"}
    policy["type"] = "grpo" if rl_keys & policy.keys() else "sft"


def grpo_side_effects(policy: dict[str, Any], train: dict[str, Any], data: dict[str, Any]) -> None:
    """cosmos-rl's GRPO rules, and the variant's defaults for the keys not set."""
    variant = policy.get("variant", "grpo")
    for key, value in VARIANT_DEFAULTS.get(variant, {}).items():
        policy.setdefault(key, value)
    rollout = data.get("rollout")
    rollout = rollout if isinstance(rollout, dict) else {}
    sampling = rollout.get("sampling_config")
    sampling = sampling if isinstance(sampling, dict) else {}
    if "use_rollout_logprobs_for_loss" not in policy and not policy.get("use_decoupled_loss"):
        # cosmos-rl configs often compute log-probs at another temperature than they sample at
        # (e.g. 0.9 and 1.0); the rollout's log-probs are then no proximal policy.
        policy["use_rollout_logprobs_for_loss"] = policy.get("temperature", 1.0) == sampling.get(
            "temperature", 1.0
        )
    if policy.get("on_policy"):
        policy["allowed_outdated_steps"] = 0
    allowed = policy.get("allowed_outdated_steps", 4)
    sync = train.get("sync_weight_interval", 1)
    if isinstance(allowed, int) and isinstance(sync, int) and allowed + 1 < sync:
        # Rollouts hold weights up to sync - 1 steps old between pushes.
        policy["allowed_outdated_steps"] = allowed = sync - 1
    inflight = policy.get("max_inflight_steps")
    if isinstance(inflight, int) and isinstance(allowed, int) and inflight < allowed + 1:
        policy["max_inflight_steps"] = allowed + 1
    # (cosmos-rl raises outdated_rollout_fetch_batch_size to 128 for dapo, to hand out prompts
    # past its throttle; nebula-rl's release never goes past the staleness bound.)
    if policy.get("use_decoupled_loss"):
        policy["collect_rollout_logprobs"] = True
        policy.setdefault("use_rollout_logprobs_for_loss", False)
    if policy.get("use_rollout_logprobs_for_loss"):
        policy["collect_rollout_logprobs"] = True


def distillation_side_effects(data: dict[str, Any], policy: dict[str, Any]) -> None:
    """cosmos-rl's `[distillation]` rules: distillation trains on the teacher's signal alone
    (`bypass_reward` forced on; nebula-rl always sends token ids, cosmos-rl's other forced key),
    and `top_k` <= 0 takes no top-k ids from the teacher; without it `top_k` is 0 (and the other
    keys, which nothing reads then, keep their values)."""
    distill = data.get("distillation")
    if not isinstance(distill, dict):
        return
    if not (distill.get("enable") and policy.get("type") == "grpo"):  # (SFT: refused by name)
        distill["top_k"] = 0
        return
    if policy.get("bypass_reward") is False:
        log.warning(
            "distillation.enable forces train.train_policy.bypass_reward = true (as cosmos-rl "
            "does): the task reward is not trained on"
        )
    policy["bypass_reward"] = True
    top_k = distill.get("top_k", 0)
    if isinstance(top_k, int) and top_k <= 0:
        distill["trainer_token_ids_from_teacher"] = False


def pop_stale(data: dict[str, Any]) -> list[str]:
    """Remove `STALE_KEYS` from the raw tables; a warning for each one found."""
    warnings = []
    policy = (
        data.get("train", {}).get("train_policy") if isinstance(data.get("train"), dict) else None
    )
    if (
        isinstance(policy, dict)
        and policy.get("type") == "grpo"
        and "conversation_column_name" in policy
    ):
        del policy["conversation_column_name"]
        warnings.append(
            "train.train_policy.conversation_column_name: ignored, as cosmos-rl ignores it (an "
            "SFT key; GRPO reads prompt_column_name)"
        )
    for key, why in STALE_KEYS.items():
        *parents, leaf = key.split(".")
        table: Any = data
        for part in parents:
            table = table.get(part) if isinstance(table, dict) else None
        if isinstance(table, dict) and leaf in table:
            del table[leaf]
            warnings.append(f"{key}: ignored, as cosmos-rl ignores it ({why})")
    return warnings


TRAINER_ALIASES = {"custom_grpo_example": "grpo"}
"""cosmos-rl's example trainers that are its own trainer unchanged (every override of
`tools/example/custom_grpo_trainer.py` calls the base class) -> the nebula-rl trainer that runs
them; a config naming one is noted, not refused."""

OTHER_TRAINERS = {
    "grpo_vla": NO_VLA,
    "grpo_pi05": NO_VLA,
    "pi_sft": NO_VLA,
    "cosmos_policy": NO_VLA,
    "diffusion_nft": "needs policy.is_diffusers = true (world-model training)",
    "flow_grpo": "needs policy.is_diffusers = true (world-model training)",
    "ddrl": "needs policy.is_diffusers = true (world-model training)",
    "diffusers_sft": "needs policy.is_diffusers = true (world-model training)",
    "dpo": "DPO is not supported yet",
}
