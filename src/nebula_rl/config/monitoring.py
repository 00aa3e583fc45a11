"""`[logging]`, `[profiler]` and `[validation]`: what a run reports and evaluates."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from nebula_rl.config.base import (
    NEEDS_CUDA,
    RewardSpec,
    Section,
    refused,
    reward_weights,
)
from nebula_rl.config.data import DatasetConfig
from nebula_rl.config.reward import RemoteRewardConfig


class LoggingConfig(Section):
    """Where each step's metrics go besides `<run>/metrics.jsonl`, which is always written."""

    logger: list[Literal["console", "tensorboard", "wandb"]] = ["console"]  # noqa: RUF012
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


class SubProfilerConfig(Section):
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


class ProfilerConfig(Section):
    """torch.profiler traces of training steps."""

    enable_profiler: bool = False
    """Trace training steps into `<run>/profile_trace/<replica>_<rank>/` (Chrome trace JSON,
    readable in Perfetto or TensorBoard)."""
    enable_nsys: bool = Field(
        default=False, json_schema_extra=refused("Nsight Systems profiling " + NEEDS_CUDA)
    )
    """Run under Nsight Systems."""
    sub_profiler_config: SubProfilerConfig = Field(default_factory=SubProfilerConfig)
    """What is recorded."""


class ValidationConfig(Section):
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
        return reward_weights(v)
