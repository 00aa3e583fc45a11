"""The whole job's tree, `Config`, with `[vla]` and `[controller]`, and the rules between its
sections that make a config invalid.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    model_validator,
)

from nebula_rl.config.algorithm import DistillationConfig, GrpoConfig
from nebula_rl.config.base import NO_VLA, Section, refused
from nebula_rl.config.compat.cosmos import (
    distillation_side_effects,
    grpo_side_effects,
    infer_policy_type,
)
from nebula_rl.config.monitoring import LoggingConfig, ProfilerConfig, ValidationConfig
from nebula_rl.config.policy import PolicyConfig
from nebula_rl.config.rollout import RolloutConfig
from nebula_rl.config.training import TrainingConfig


class VLAConfig(Section):
    """Vision-language-action training (cosmos-rl's `[vla]`)."""

    vla_type: str = Field(default="openvla-oft", json_schema_extra=refused(NO_VLA))
    """Model family."""
    num_envs: int = Field(default=1, json_schema_extra=refused(NO_VLA))
    """Environments."""
    use_proprio: bool = Field(default=False, json_schema_extra=refused(NO_VLA))
    """Proprioception input."""
    proprio_dim: int = Field(default=7, json_schema_extra=refused(NO_VLA))
    """Proprioception size."""
    num_images_in_input: int = Field(default=1, json_schema_extra=refused(NO_VLA))
    """Images per input."""
    training_chunk_size: int = Field(default=16, json_schema_extra=refused(NO_VLA))
    """Chunks per iteration."""
    save_video: bool = Field(default=False, json_schema_extra=refused(NO_VLA))
    """Save validation videos."""
    continuous: bool = Field(default=False, json_schema_extra=refused(NO_VLA))
    """Continuous simulation."""
    trace_verbosity: int = Field(default=1, json_schema_extra=refused(NO_VLA))
    """Trace verbosity."""
    unnorm_key: str = Field(default="libero_10_no_noops", json_schema_extra=refused(NO_VLA))
    """Action un-normalisation key."""
    max_steps: int | None = Field(default=None, json_schema_extra=refused(NO_VLA))
    """Steps per episode."""
    use_subprocess: bool | None = Field(default=None, json_schema_extra=refused(NO_VLA))
    """Simulator in a subprocess."""


class ControllerConfig(Section):
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


class Config(Section):
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
        infer_policy_type(policy)
        if train.get("deterministic") and train.get("seed") is None:
            train["seed"] = 42
        if isinstance(train.get("seed"), int) and train["seed"] < 0:
            train["seed"] = 42
        if policy.get("type") == "grpo":
            grpo_side_effects(policy, train, data)
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
        distillation_side_effects(data, policy)
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
