"""The mesh sizes of a policy replica: `[policy.parallelism]` and the world size turned into
the DeviceMesh (axes `MESH_AXES`), checked against the model; the one place that builds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import PretrainedConfig

from nebula_rl.config import ParallelismConfig
from nebula_rl.policy.parallelize.structure import windowed_attention
from nebula_rl.policy.parallelize.tensor_parallel import TP_PLANS

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Names of the device mesh's axes, outermost first."""

KEY = "policy.parallelism"

LossFn = Callable[[Tensor, Tensor], Tensor]
"""(logits [b, l, V], labels [b, l, ...]) -> this piece's share of the global loss (a scalar)."""


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Sizes of the mesh axes of one policy replica; their product is its world size."""

    pp: int
    """Pipeline stages."""
    dp_replicate: int
    """Replicated data parallel (DDP, or HSDP's outer axis)."""
    dp_shard: int
    """Sharded data parallel (FSDP2, or HSDP's inner axis)."""
    cp: int
    """Context parallel (sequence sharded in attention)."""
    tp: int
    """Tensor parallel, with sequence parallel on the norms."""

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, *, world_size: int) -> ParallelDims:
        """Sizes from `[policy.parallelism]`, with `dp_shard_size = -1` inferred."""
        others = cfg.pp_size * cfg.dp_replicate_size * cfg.cp_size * cfg.tp_size
        dp_shard = cfg.dp_shard_size
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"{KEY}: pp_size * dp_replicate_size * cp_size * tp_size ({others}) must "
                    f"divide the world size ({world_size}) to infer dp_shard_size"
                )
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise ValueError(
                f"{KEY}: pp_size ({cfg.pp_size}) * dp_replicate_size ({cfg.dp_replicate_size}) * "
                f"dp_shard_size ({dp_shard}) * cp_size ({cfg.cp_size}) * tp_size ({cfg.tp_size}) "
                f"= {others * dp_shard} must equal the world size ({world_size})"
            )
        return cls(
            pp=cfg.pp_size, dp_replicate=cfg.dp_replicate_size, dp_shard=dp_shard,
            cp=cfg.cp_size, tp=cfg.tp_size,
        )  # fmt: skip

    @property
    def world_size(self) -> int:
        """Ranks in the mesh."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks, each with its own rows of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded; CP ranks join the shard axis so FSDP sums their gradients."""
        return self.dp_shard * self.cp > 1

    def check_model(self, config: PretrainedConfig) -> None:
        """Raise a ValueError naming the config key if `config`'s model cannot be split so."""
        if getattr(config, "vision_config", None) is not None:
            split = [f"{k}_size" for k, n in (("pp", self.pp), ("cp", self.cp)) if n > 1]
            if split:
                raise ValueError(
                    f"{KEY}.{', '.join(split)} > 1: a vision-language model ({config.model_type}) "
                    "is split data-parallel (FSDP2 shards its vision blocks and decoder layers "
                    "alike) and tensor-parallel (tp_size: its language model) only so far"
                )
            config = config.get_text_config()
        if self.tp > 1:
            if config.model_type not in TP_PLANS:
                raise ValueError(
                    f"{KEY}.tp_size > 1 has no plan for model_type {config.model_type!r}; "
                    f"supported: {sorted(TP_PLANS)}"
                )
            for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
                value = getattr(config, name)
                if value % self.tp:
                    raise ValueError(f"{KEY}.tp_size ({self.tp}) must divide {name} ({value})")
            if config.vocab_size % self.tp:
                raise ValueError(
                    f"{KEY}.tp_size ({self.tp}) must divide vocab_size ({config.vocab_size})"
                )
        if self.pp > config.num_hidden_layers:
            raise ValueError(
                f"{KEY}.pp_size ({self.pp}) must not exceed num_hidden_layers "
                f"({config.num_hidden_layers}): every stage needs a decoder layer"
            )
        if self.cp > 1 and self.pp > 1:
            raise ValueError(f"{KEY}: cp_size > 1 together with pp_size > 1 is not supported")
        if self.cp > 1 and config._attn_implementation != "sdpa":
            raise ValueError(
                f"{KEY}.cp_size > 1 needs SDPA attention (context parallelism replaces its "
                f"calls); the model uses {config._attn_implementation!r}"
            )
        if self.cp > 1 and windowed_attention(config):
            raise ValueError(
                f"{KEY}.cp_size > 1 splits sequences under a plain causal mask; this model's "
                "sliding-window attention layers are not supported with it"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh over all ranks of the default process group, plus flattened axes
        "dp" (data loading), "dp_shard_cp" (FSDP sharding) and "dp_cp" (loss sums)."""
        assert dist.get_world_size() == self.world_size, (dist.get_world_size(), self)
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_AXES,
        )
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh
