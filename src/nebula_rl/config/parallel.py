"""`[policy.parallelism]` and `[rollout.parallelism]`: how one replica is split over devices."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
)

from nebula_rl.config.base import Section, refused

PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


class ParallelismConfig(Section):
    """How one replica is split over devices: a mesh (pp, dp_replicate, dp_shard, cp, tp)."""

    n_init_replicas: int = Field(default=1, ge=1)
    """Replicas started with the job."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor parallel (with sequence parallel)."""
    cp_size: int = Field(default=1, ge=1)
    """Context parallel: ranks that split each sample (a language model: torch's ring attention
    on CUDA, all-gathered keys and values elsewhere; a flow model, the built-in DiT or a
    diffusers Cosmos / Wan transformer: by whole frames; Cosmos 3's generator: by equal shares
    of its latent patches; any device)."""
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

    @property
    def world_size(self) -> int | None:
        """Processes (devices) of one replica; None when `dp_shard_size = -1` leaves it open."""
        if self.dp_shard_size == -1:
            return None
        return (
            self.pp_size * self.dp_replicate_size * self.dp_shard_size * self.cp_size * self.tp_size
        )

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
