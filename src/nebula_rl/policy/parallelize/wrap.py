"""What wraps the model after tensor parallelism: activation checkpointing, compile, and the
data parallelism (FSDP2/HSDP, DDP, and the vision tower sharded over the TP ranks)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nebula_rl.policy.parallelize.dims import ParallelDims
from nebula_rl.policy.parallelize.structure import decoder_layers, vision_blocks, vision_modules

# Activation checkpointing, compile, data parallel


def apply_ac(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (composable, names unchanged)."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(model):
        checkpoint(layer)


def apply_compile(model: nn.Module) -> None:
    """`torch.compile` each decoder layer in place (the layers are alike, so compiled once)."""
    for layer in decoder_layers(model):
        layer.compile()


def sum_gradients(model: nn.Module, divide: float = 1.0) -> None:
    """Make every FSDP/replicate group sum gradients over its data axes instead of averaging:
    each rank's loss is already its share of the global loss (module docstring). With
    `divide`, the sums are divided by it."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(divide)
            # A plain SUM: gloo has no AVG/PREMUL_SUM, and a factor of 1 needs no scaling.
            module.set_force_sum_reduction_for_comms(True)


def _fsdp_precision(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> Any:
    """FSDP2's mixed precision: gather parameters in `param_dtype` for forward and backward
    (None: their own dtype, the master copy's), reduce gradients in `reduce_dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: Literal["always", "never", "default"] = "default",
    pipelined: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    offload: bool = False,
) -> None:
    """FSDP2 over `dp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP): one group per decoder
    layer, then the root, which holds the embedding, final norm and (tied) head together.

    `reshard_after_forward` (`train.fsdp_reshard_after_forward`): whether a group frees its
    gathered parameters after forward, "always" or "never" for every group; "default" is
    torch's default (the layers do, the root does not: its parameters are needed again as soon
    as backward starts), except for a `pipelined` stage, whose layers do not either (it runs
    several micro-batches: resharding would re-gather them for each). `param_dtype` /
    `reduce_dtype` are the mixed precision (`train.param_dtype`, `train.fsdp_reduce_dtype`);
    `offload` keeps the shards and optimiser state in host memory (`train.fsdp_offload`, CUDA
    only).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if offload and dp_mesh.device_type != "cuda":
        raise ValueError(
            "train.fsdp_offload moves the sharded parameters from GPU to host memory; this "
            f"replica's devices are {dp_mesh.device_type!r}, so there is nothing to offload"
        )
    reshard = {"always": True, "never": False, "default": False if pipelined else None}
    kwargs: dict[str, Any] = dict(
        mesh=dp_mesh,
        reshard_after_forward=reshard[reshard_after_forward],
        mp_policy=_fsdp_precision(param_dtype, reduce_dtype),
        offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
    )
    from torch.distributed.fsdp import FSDPModule

    for layer in [*vision_blocks(model), *decoder_layers(model)]:
        if not isinstance(layer, FSDPModule):  # (a vision block `shard_vision_over_tp` took)
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    sum_gradients(model)


def shard_vision_over_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """FSDP2 of a vision-language model's vision tower over the data and TP ranks together
    (`tp_size > 1`; the language model is TP-split): the tower is never TP-split, and with its
    parameters sharded like the language model's DTensors every parameter of the model is one.
    Each block is a group, then the tower's root (patch and position embeddings, mergers).

    TP ranks run the same rows, so their tower gradients are equal: summed over the TP ranks
    they are divided by `tp_size` again, and data ranks' are summed as everywhere (set after
    the data-parallel step, whose own setting covers every FSDP group)."""
    from torch.distributed.fsdp import fully_shard

    axes = ("dp_shard", "cp", "tp")
    if "dp_shard_cp_tp" not in (mesh.mesh_dim_names or ()):
        mesh[axes]._flatten("dp_shard_cp_tp")
    over = (
        mesh["dp_replicate", "dp_shard_cp_tp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp_tp"]
    )
    kwargs: dict[str, Any] = dict(mesh=over, mp_policy=_fsdp_precision(param_dtype, reduce_dtype))
    for block in vision_blocks(model):
        fully_shard(block, **kwargs)
    for module in vision_modules(model):  # (the tower's root, and a projector outside it)
        fully_shard(module, **kwargs)


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """Replicated data parallel over `dp_mesh` (FSDP2's replicate: one all-reduce per layer),
    with the mixed precision of `apply_fsdp`."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    precision = _fsdp_precision(param_dtype, reduce_dtype)
    for layer in decoder_layers(model):
        replicate(layer, mesh=dp_mesh, mp_policy=precision)
    replicate(model, mesh=dp_mesh, mp_policy=precision)
    sum_gradients(model)
