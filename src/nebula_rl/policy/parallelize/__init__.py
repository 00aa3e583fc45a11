"""Policy parallelism: how one policy replica's model is split over its devices.

`ParallelDims` turns `[policy.parallelism]` and the world size into mesh sizes, checks them against
the model and is the one place that builds the DeviceMesh, with axes
("pp", "dp_replicate", "dp_shard", "cp", "tp"). `parallelize_model` applies one `apply_*` per
parallelism in torchtitan's order (see its comments) and returns a :class:`ParallelModel`, whose
`run` / `forward_backward` runs one batch the way the parallelism needs: a plain forward (and
backward), a pipeline schedule (PP: GPipe, 1F1B, or Interleaved1F1B with several stages per
rank), or with each sequence split over the CP ranks (torch's `context_parallel` on CUDA,
`sequence_split.GatheredAttention` elsewhere).

Loss convention (STYLE rule 3): `loss_fn` returns its tokens' *share of the global loss*: a sum
over the tokens it sees divided by a global count that the caller passes in. Shares then add up
exactly, so gradients are summed, never averaged, over the data axes (dp_replicate, dp_shard, cp)
and over pipeline micro-batches, and the result does not depend on how the batch was split.

Simplifications: pipeline stages hold whole decoder layers, in equal numbers; under PP and CP
batches are unpadded or right-padded (the causal mask alone is exact there, so no attention mask
is taken); CP needs SDPA attention and cannot be combined with PP; the TP plan covers
the Llama, Qwen2 and Qwen3 families and the language models of Qwen2.5-VL and Qwen3-VL (whose vision
tower FSDP2 shards over the TP ranks instead: `shard_vision_over_tp`); PP and CP of a
vision-language model are refused.

The code: `dims` (mesh sizes), `tensor_parallel`, `pipeline`, `wrap` (activation checkpointing,
compile, FSDP2/HSDP, DDP) and `model` (the composition).
"""

from nebula_rl.policy.parallelize.dims import MESH_AXES, LossFn, ParallelDims
from nebula_rl.policy.parallelize.model import (
    ParallelModel,
    parallelize_model,
    total_grad_norm,
    whole_model_loss,
)
from nebula_rl.policy.parallelize.pipeline import (
    PP_SCHEDULES,
    pipeline_stage_layers,
    split_pipeline,
    split_pipeline_stage,
)
from nebula_rl.policy.parallelize.tensor_parallel import TP_PLANS, apply_tp
from nebula_rl.policy.parallelize.wrap import apply_ac, apply_compile, apply_ddp, apply_fsdp

__all__ = [
    "MESH_AXES",
    "PP_SCHEDULES",
    "TP_PLANS",
    "LossFn",
    "ParallelDims",
    "ParallelModel",
    "apply_ac",
    "apply_compile",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "parallelize_model",
    "pipeline_stage_layers",
    "split_pipeline",
    "split_pipeline_stage",
    "total_grad_norm",
    "whole_model_loss",
]
