"""`[train.train_policy]`: GRPO and its variants (with each variant's documented defaults), SFT,
and on-policy `[distillation]`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from nebula_rl.config.base import (
    NO_LOAD_BALANCE,
    Dtype,
    RewardSpec,
    Section,
    refused,
    reward_weights,
)
from nebula_rl.config.data import DatasetConfig
from nebula_rl.config.parallel import ParallelismConfig
from nebula_rl.config.reward import OverlongRewardConfig, RemoteRewardConfig

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


class GrpoConfig(Section):
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
    """Colocated mode: rollouts go to the local policy without the controller (world models:
    `nebula-rl train`'s own ranks sample and train; refused for language models)."""
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
        value = reward_weights(v)
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


class SftConfig(Section):
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
    enable_dp_load_balancing: bool = Field(
        default=False, json_schema_extra=refused(NO_LOAD_BALANCE)
    )
    """Load-balanced dynamic batching across data-parallel ranks."""
    load_balanced_pool_size: int = Field(default=32, json_schema_extra=refused(NO_LOAD_BALANCE))
    """Sample pool per rank for load-balanced batching."""
    load_balanced_max_tokens_for_batch: int | None = Field(
        default=None, json_schema_extra=refused(NO_LOAD_BALANCE)
    )
    """Token budget of a load-balanced batch."""
    load_balanced_batching_strategy: str = Field(
        default="prefer_closest", json_schema_extra=refused(NO_LOAD_BALANCE)
    )
    """`prefer_closest` or `prefer_first`."""
    load_balanced_batches_per_optimizer_step: int = Field(
        default=1, json_schema_extra=refused(NO_LOAD_BALANCE)
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


class DistillationConfig(Section):
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
