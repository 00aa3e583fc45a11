"""One typed configuration tree, loaded from TOML and validated at load.

Section and key names follow cosmos-rl's documented configuration (``[train]``,
``[train.train_policy]``, ``[policy.parallelism]``, ``[rollout.sampling_config]``, ...) so that a
user of that system can bring a config. Keys nebula-rl adds are marked "nebula-rl" in their
docstring. Every model forbids unknown keys; :func:`load_config` turns validation failures into a
:class:`ConfigError` naming the file and the dotted key.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ControllerConfig",
    "DatasetConfig",
    "GrpoConfig",
    "LoggingConfig",
    "OverlongRewardConfig",
    "ParallelismConfig",
    "PolicyConfig",
    "RolloutConfig",
    "RolloutParallelismConfig",
    "SamplingConfig",
    "SftConfig",
    "TrainingConfig",
    "ValidationConfig",
    "config_from_dict",
    "load_config",
]


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the dotted key."""


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


RewardSpec = str | list[str] | dict[str, float]


def _normalize_reward_spec(value: RewardSpec) -> dict[str, float]:
    if isinstance(value, str):
        value = {value: 1.0}
    elif isinstance(value, list):
        value = dict.fromkeys(value, 1.0)
    if not value:
        raise ValueError("needs at least one reward function")
    return value


class DatasetConfig(_Section):
    """Where a dataset comes from: a local file or folder, or a built-in task."""

    name: str = ""
    """Local path to a JSONL/JSON/Parquet/CSV file, a folder of such files or a saved HF `datasets`
    folder; or `builtin:<task>` for a procedurally generated task (e.g. `builtin:arithmetic`)."""
    subset: str = ""
    """Dataset subset (configuration name), where the source has several."""
    revision: str = ""
    """Dataset revision; accepted for compatibility, unused for local files."""
    split: str | list[str] = "train"
    """Split(s) to train on: for a folder, files named `<split>.jsonl` / `<split>.parquet` / ..."""
    test_size: float | int | None = None
    """Held-out part for validation: a fraction in (0, 1) or a number of rows; None keeps all."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """nebula-rl: options passed to a built-in task generator (e.g. `max_operand`, `num_samples`)."""

    @field_validator("split")
    @classmethod
    def _split_as_list(cls, v: str | list[str]) -> list[str]:
        return [v] if isinstance(v, str) else v


class OverlongRewardConfig(_Section):
    """DAPO's soft overlong punishment (Yu et al., 2025)."""

    enable_overlong_penalty: bool = False
    """Penalise responses whose length enters the last `buffer_length` tokens before the maximum."""
    buffer_length: int = Field(default=4096, ge=1)
    """Length in tokens of the window, ending at `rollout.max_response_length`, over which the
    penalty grows linearly from 0 to `penalty_factor`."""
    penalty_factor: float = Field(default=1.0, ge=0.0)
    """Largest penalty (subtracted from the reward) at and beyond the maximum length."""


class GrpoConfig(_Section):
    """Reinforcement learning from verifiable rewards: GRPO and its variants."""

    type: Literal["grpo"] = "grpo"
    """Selects this training mode."""
    variant: Literal["grpo", "dapo", "gspo", "aipo"] = "grpo"
    """Algorithm: `grpo` (Shao et al. 2024), `dapo` (clip-higher, token-mean, dynamic sampling;
    Yu et al. 2025), `gspo` (sequence-level ratio; Zheng et al. 2025), `aipo` (truncated
    off-policy weights; Wang et al. 2025)."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """Prompt dataset."""
    dataloader_shuffle: bool = True
    """Shuffle prompts each epoch (seeded by `train.seed`)."""
    prompt_column_name: str = "prompt"
    """Column holding the prompt text (a string, or a list of chat messages)."""
    response_column_name: str = "answer"
    """Column holding the reference answer that reward functions compare against."""
    system_prompt: str = ""
    """nebula-rl: system message prepended to every prompt ("" for none)."""
    reward_function: RewardSpec = Field(default_factory=lambda: {"boxed_math": 1.0})
    """Reward function(s) by registered name or `module:function`: a name, a list (weight 1 each),
    or a table of name = weight."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature the log-probs are computed at; must equal
    `rollout.sampling_config.temperature`."""
    epsilon_low: float = Field(default=0.2, ge=0.0)
    """PPO clip range below 1: the ratio is clipped at 1 - epsilon_low."""
    epsilon_high: float = Field(default=0.2, ge=0.0)
    """PPO clip range above 1 (DAPO's clip-higher recommends 0.28)."""
    lower_bound_ratio: float | None = 3.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (Ye et al. 2020);
    unset to disable."""
    loss_type: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses are reduced; `seq-mean-token-sum-norm` is Dr.GRPO's constant normaliser."""
    unbiased_loss_max_tokens: int | None = None
    """Dr.GRPO's constant normaliser (tokens) for `seq-mean-token-sum-norm`; defaults to
    `rollout.max_response_length`."""
    unbiased_advantage: bool = False
    """Do not divide advantages by the group's reward std (Dr.GRPO)."""
    overlong_reward: OverlongRewardConfig = Field(default_factory=OverlongRewardConfig)
    """Soft overlong penalty."""
    kl_beta: float = Field(default=0.0, ge=0.0)
    """Coefficient of the k3 KL estimate to the initial (reference) policy; 0 loads no reference."""
    entropy_coef: float = Field(default=0.0, ge=0.0)
    """nebula-rl: coefficient of the entropy bonus (subtracted from the loss)."""
    aipo_rho: float | None = None
    """AIPO truncation constant of the behaviour importance ratio (suggested 2-10); used by
    `variant = "aipo"`."""
    decoupled_loss: bool = False
    """nebula-rl: decoupled PPO (Hilton et al. 2022): clip against the proximal policy and weight
    each token by pi_prox / pi_behaviour from the rollout's log-probs."""
    behaviour_weight_cap: float | None = None
    """nebula-rl: upper bound on the decoupled-PPO behaviour weight (None: no bound)."""
    dynamic_sampling: bool | None = None
    """nebula-rl: drop groups whose rewards are all equal and sample more (DAPO); default on for
    `variant = "dapo"`, off otherwise."""
    mu_iterations: int = Field(default=1, ge=1)
    """Optimisation passes over each training batch (mu in the GRPO paper)."""
    mini_batch: int = Field(default=2, ge=1)
    """Sequences per forward/backward; gradients accumulate over a training batch."""
    allowed_outdated_steps: int = Field(default=4, ge=0)
    """Largest allowed policy-version lag of a sample at training time; 0 is synchronous."""
    on_policy: bool = False
    """Fully synchronous: rollouts wait for the newest weights before generating."""

    @field_validator("reward_function")
    @classmethod
    def _rewards_as_dict(cls, v: RewardSpec) -> dict[str, float]:
        return _normalize_reward_spec(v)

    @property
    def dynamic_sampling_enabled(self) -> bool:
        """Whether all-equal groups are dropped (explicit setting, else on for DAPO)."""
        return self.variant == "dapo" if self.dynamic_sampling is None else self.dynamic_sampling


class SftConfig(_Section):
    """Supervised fine-tuning on chat conversations, loss on assistant tokens only."""

    type: Literal["sft"] = "sft"
    """Selects this training mode."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """Conversation dataset."""
    mini_batch: int = Field(default=2, ge=1)
    """Sequences per forward/backward; gradients accumulate over a training batch."""
    dataloader_shuffle: bool = True
    """Shuffle rows each epoch (seeded by `train.seed`)."""
    conversation_column_name: str = "conversations"
    """Column holding a list of {role, content} messages."""
    prompt_column_name: str = ""
    """nebula-rl: with `response_column_name`, build a two-turn conversation from these columns
    instead of reading `conversation_column_name`."""
    response_column_name: str = ""
    """nebula-rl: column of the assistant's answer (see `prompt_column_name`)."""
    system_prompt: str = ""
    """System message prepended to every conversation ("" for none)."""


TrainPolicy = Annotated[GrpoConfig | SftConfig, Field(discriminator="type")]


class CheckpointConfig(_Section):
    """Checkpoints (torch.distributed.checkpoint) and Hugging Face safetensors exports."""

    enable_checkpoint: bool = False
    """Save resumable checkpoints every `save_freq` steps."""
    save_freq: int = Field(default=20, ge=1)
    """Steps between checkpoints."""
    save_mode: Literal["async", "sync"] = "async"
    """Write checkpoints in the background (`async`) or block the step (`sync`)."""
    max_keep: int = Field(default=5, ge=-1)
    """Checkpoints kept on disk; -1 keeps all."""
    export_safetensors: bool = True
    """Also export HF safetensors (`safetensors/step_N/`, and `safetensors/final/` at the end)."""

    @field_validator("max_keep")
    @classmethod
    def _keep_some(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be -1 (keep all) or at least 1")
        return v


class TrainingConfig(_Section):
    """The optimiser, the schedule and the run's outputs."""

    train_policy: TrainPolicy = Field(default_factory=GrpoConfig)
    """Training mode: `[train.train_policy] type = "grpo"` or `"sft"`."""
    optm_name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimiser."""
    optm_lr: float = Field(default=1e-6, gt=0.0)
    """Peak learning rate."""
    optm_impl: Literal["fused", "foreach", "for-loop"] = "foreach"
    """Optimiser kernel implementation (`fused` needs a device that supports it)."""
    optm_weight_decay: float = Field(default=0.01, ge=0.0)
    """Decoupled weight decay."""
    optm_betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    optm_warmup_steps: int | float = Field(default=20, ge=0)
    """Linear warm-up steps; a float in [0, 1] is a fraction of the total steps."""
    optm_decay_type: Literal["none", "linear", "cosine", "sqrt"] | None = None
    """Decay after warm-up (None or `none`: constant)."""
    optm_min_lr_factor: float = Field(default=0.0, ge=0.0, le=1.0)
    """Floor of the decayed learning rate as a fraction of `optm_lr`."""
    optm_grad_norm_clip: float = Field(default=1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables."""
    epsilon: float = Field(default=1e-8, gt=0.0)
    """Adam epsilon."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of forward/backward (cosmos-rl defaults to bfloat16; float32 suits CPU)."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights the optimiser updates."""
    transfer_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of weights sent to rollouts; defaults to `param_dtype`."""
    compile: bool = False
    """Compile the model with torch.compile."""
    train_batch_per_replica: int = Field(default=8, ge=1)
    """Prompt groups (GRPO) or conversations (SFT) per optimiser step on each policy replica."""
    sync_weight_interval: int = Field(default=1, ge=1)
    """Optimiser steps between weight pushes to rollout replicas."""
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    resume: bool | str = False
    """Resume from the latest checkpoint under the run directory (true) or from a path."""
    epoch: int = Field(default=1, ge=1)
    """Passes over the dataset."""
    max_num_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimiser steps, even within an epoch."""
    output_dir: str = "./outputs"
    """Directory under which each run gets a folder."""
    timestamp: str = ""
    """Run folder name; generated from the start time when empty."""
    seed: int | None = 42
    """Seed for initialisation, shuffling and sampling."""
    deterministic: bool = False
    """Use deterministic kernels (slower)."""
    sequence_packing: bool = False
    """SFT: pack conversations into rows of up to `policy.model_max_length` tokens (block-diagonal
    attention, positions restart per conversation); no effect on RL."""
    fsdp_reshard_after_forward: Literal["always", "never", "default"] = "default"
    """FSDP2: free gathered parameters after forward."""
    fsdp_offload: bool = False
    """FSDP2: keep parameters and optimiser state in CPU memory."""

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        on_policy = isinstance(self.train_policy, GrpoConfig) and self.train_policy.on_policy
        if on_policy and self.sync_weight_interval != 1:
            raise ValueError("sync_weight_interval must be 1 when train_policy.on_policy is true")
        if self.resume is True and not self.timestamp:
            raise ValueError(
                "train.resume = true resumes the run folder train.output_dir/train.timestamp: "
                "set train.timestamp, or set train.resume to a checkpoint folder"
            )
        return self


class ParallelismConfig(_Section):
    """How one policy replica is split over devices: a mesh (pp, dp_replicate, dp_shard, cp, tp)."""

    n_init_replicas: int = Field(default=1, ge=1)
    """Replicas started with the job."""
    dp_replicate_size: int = Field(default=1, ge=1)
    """Replicated data parallel (DDP, or the outer axis of HSDP)."""
    dp_shard_size: int = Field(default=-1, ge=-1)
    """Sharded data parallel (FSDP2); -1 takes what the other axes leave of the world size."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor parallel (with sequence parallel)."""
    cp_size: int = Field(default=1, ge=1)
    """Context parallel."""
    pp_size: int = Field(default=1, ge=1)
    """Pipeline parallel stages."""
    pp_micro_batch_size: int = Field(default=1, ge=1)
    """Sequences per pipeline micro-batch."""

    @field_validator("dp_shard_size")
    @classmethod
    def _nonzero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be >= 1, or -1 to infer it from the world size")
        return v


class RolloutParallelismConfig(_Section):
    """How one rollout replica is split over devices."""

    n_init_replicas: int = Field(default=1, ge=1)
    """Replicas started with the job."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor parallel."""
    pp_size: int = Field(default=1, ge=1)
    """Pipeline parallel stages."""


class PolicyConfig(_Section):
    """The model being trained."""

    model_name_or_path: str = "tiny:qwen2"
    """Local path of a Hugging Face causal LM folder, or a built-in preset `tiny:<name>` (random
    init, local character tokenizer). Nothing is downloaded."""
    model_revision: str | None = None
    """Accepted for compatibility; unused for local paths."""
    model_max_length: int = Field(default=4096, ge=8)
    """Longest sequence (prompt + response) in tokens; longer samples are truncated."""
    model_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    warmstart_config: str | None = None
    """nebula-rl: if `model_name_or_path` does not exist yet, first run this (SFT) config, whose
    final export must land at that path."""
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    """Policy parallelism."""


class SamplingConfig(_Section):
    """How rollouts sample tokens."""

    temperature: float = Field(default=1.0, gt=0.0)
    """Softmax temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Sample among the k most likely tokens; -1 for all."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """Accepted for compatibility; only 1.0 is supported (a penalty skews the RL log-probs)."""

    @field_validator("repetition_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 1.0:
            raise ValueError("only 1.0 is supported")
        return v


class RolloutConfig(_Section):
    """Generation."""

    backend: Literal["torch", "vllm"] = "torch"
    """Engine: the built-in `torch` engine, or `vllm` where installed."""
    n_generation: int = Field(default=8, ge=1)
    """Completions per prompt (the GRPO group size)."""
    batch_size: int = Field(default=8, ge=1)
    """Prompts a rollout replica takes at once."""
    max_response_length: int = Field(default=2048, ge=1)
    """Most tokens generated per completion."""
    max_num_seqs: int = Field(default=256, ge=1)
    """nebula-rl: sequences decoded together (the engine's KV-cache slots)."""
    seed: int | None = None
    """Sampling seed; defaults to `train.seed`."""
    reward_workers: int = Field(default=1, ge=0)
    """nebula-rl: processes that score completions (0: score in the rollout process)."""
    include_stop_str_in_output: bool = False
    """Keep a matched stop string in the returned text."""
    gpu_memory_utilization: float = Field(default=0.8, gt=0.0, le=1.0)
    """vLLM: fraction of GPU memory it may take."""
    enforce_eager: bool = True
    """vLLM: disable CUDA graphs."""
    sampling_config: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters."""
    parallelism: RolloutParallelismConfig = Field(default_factory=RolloutParallelismConfig)
    """Rollout parallelism."""


class LoggingConfig(_Section):
    """Where each step's metrics go besides `<run>/metrics.jsonl`, which is always written."""

    logger: list[Literal["console", "tensorboard", "wandb"]] = ["console"]
    """Metric sinks: `console` (a line per step and a progress bar with reward, throughput and
    ETA), `tensorboard` (event files under `<run>/tensorboard/`), `wandb` (Weights & Biases,
    run files under `<run>/wandb/`; needs `pip install 'nebula-rl[wandb]'`)."""
    project_name: str = "nebula_rl"
    """Weights & Biases project."""
    experiment_name: str | None = None
    """Display name of the run; defaults to the run folder's name."""
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """nebula-rl: `auto` logs online when an API key is found (`WANDB_API_KEY` or a `wandb
    login`), else offline into `<run>/wandb/` (upload later with `wandb sync`); `WANDB_MODE`
    in the environment overrides `auto`."""
    report_mfu: bool = False
    """Accepted for compatibility; only false is supported (no MFU is computed yet)."""

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

    @field_validator("report_mfu")
    @classmethod
    def _no_mfu(cls, v: bool) -> bool:
        if v:
            raise ValueError("only false is supported (nebula-rl computes no MFU yet)")
        return v


class ValidationConfig(_Section):
    """Periodic evaluation on held-out data: rewards of generations (RL) or the loss (SFT)."""

    enable: bool = False
    """Run validation every `freq` steps and after the last."""
    freq: int = Field(default=20, ge=1)
    """Steps between validations."""
    batch_size: int | None = None
    """Prompts (RL) or rows per forward (SFT) of a validation batch; defaults to
    `rollout.batch_size` (RL) or `train.train_policy.mini_batch` (SFT)."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """Validation dataset, read with the training columns; an empty name uses the training
    dataset's held-out part (`train.train_policy.dataset.test_size`)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float | None = None
    """Nucleus sampling mass (None: 1.0)."""
    top_k: int | None = 1
    """Top-k (None or -1: all)."""
    n_generation: int = Field(default=1, ge=1)
    """Completions per prompt."""
    max_response_length: int | None = None
    """Most tokens per completion; defaults to `rollout.max_response_length`."""
    max_num_prompts: int | None = Field(default=None, ge=1)
    """nebula-rl: evaluate at most this many prompts (RL) or conversations (SFT), the first
    ones of the validation set (None: all)."""
    reward_function: RewardSpec = Field(default_factory=lambda: {"boxed_math": 1.0})
    """Reward function(s), as in `train.train_policy.reward_function`."""

    @field_validator("reward_function")
    @classmethod
    def _rewards_as_dict(cls, v: RewardSpec) -> dict[str, float]:
        return _normalize_reward_spec(v)


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
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    """Evaluation."""
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    """Controller."""
    redis: str = ""
    """Redis: empty starts a private server; a `redis://` URL uses an existing one."""
    custom: dict[str, Any] = Field(default_factory=dict)
    """Free-form settings for user code (reward functions, datasets)."""

    @model_validator(mode="after")
    def _check(self) -> Config:
        policy = self.train.train_policy
        if isinstance(policy, GrpoConfig):
            if policy.temperature != self.rollout.sampling_config.temperature:
                raise ValueError(
                    "train.train_policy.temperature ("
                    f"{policy.temperature}) must equal rollout.sampling_config.temperature "
                    f"({self.rollout.sampling_config.temperature}): log-probs are computed at "
                    "the temperature the rollout sampled with"
                )
            if policy.variant == "aipo" and policy.aipo_rho is None:
                raise ValueError('train.train_policy.aipo_rho must be set for variant = "aipo"')
        return self

    @property
    def grpo(self) -> GrpoConfig:
        """The GRPO settings; raises if this is not an RL config."""
        policy = self.train.train_policy
        if not isinstance(policy, GrpoConfig):
            raise ValueError('this config is not an RL config (train.train_policy.type != "grpo")')
        return policy


def _infer_policy_type(data: dict[str, Any]) -> None:
    """cosmos-rl configs may omit `train.train_policy.type`; infer it the same way."""
    policy = data.get("train", {}).get("train_policy")
    if not isinstance(policy, dict) or "type" in policy:
        return
    rl_keys = {"temperature", "epsilon_low", "epsilon_high", "kl_beta", "reward_function"}
    policy["type"] = "grpo" if rl_keys & policy.keys() else "sft"


def _dotted(loc: tuple[int | str, ...]) -> str:
    # pydantic puts the union tag ("grpo"/"sft") into the location of discriminated members.
    parts = [str(p) for p in loc if p not in ("grpo", "sft")]
    return ".".join(parts)


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        msg = msg.removeprefix("Value error, ")
        where = f"{source}: {_dotted(e['loc'])}" if e["loc"] else source
        lines.append(f"{where}: {msg}")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any], *, source: str = "<dict>") -> Config:
    """Validate a parsed config; errors raise :class:`ConfigError` naming `source` and the key."""
    data = dict(data)
    _infer_policy_type(data)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


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
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return config_from_dict(data, source=str(path))
