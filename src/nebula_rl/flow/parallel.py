"""Splitting a flow model over ranks with FSDP2, for the runtime's policy replicas
(`flow.runtime`) and the colocated one-job loop (`flow.job`): the sharding (FSDP2 over
`dp_shard_size` ranks, or HSDP: `dp_replicate_size` replicas of such shards; `cp_size` ranks
splitting each sample's tokens), frozen copies sharded alike, an export that gathers, and the
per-sample seeds that make a split step equal one process's.

The ranks of a context-parallel group form one data-parallel rank: `dp_mesh` gives the flat
mesh of the data-parallel ranks (rank, size, group), each of which takes samples of its own.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from nebula_rl.config import Config
from nebula_rl.flow.models import load_flow_model, save_flow_model
from nebula_rl.policy.parallelize.dims import ParallelDims

__all__ = [
    "BLOCK_LISTS",
    "checkpoint_blocks",
    "dp_mesh",
    "frozen_copy",
    "sample_seed",
    "save_sharded_flow_model",
    "shard_flow_model",
    "sum_over",
]


def shard_flow_model(
    model: nn.Module,
    device: torch.device,
    *,
    replicate: int = 1,
    cp: int = 1,
    mesh: DeviceMesh | None = None,
) -> DeviceMesh | None:
    """Split `model` over this replica's ranks, when it has several; the replica's mesh (None:
    one process), which `mesh` gives (a twin split like another model) or else is built over
    every rank:

    - FSDP2 over all ranks (each block a unit, then the root);
    - with `replicate` > 1 (`policy.parallelism.dp_replicate_size`), HSDP: `replicate` copies,
      each sharded over world / `replicate` ranks (gradients reduce-scattered within a copy,
      then all-reduced between copies);
    - with `cp` > 1 (`policy.parallelism.cp_size`), context parallelism: groups of `cp` ranks
      share their samples and split each one's tokens (`TinyDiT.context_parallel`,
      `DiffusersFlowModel.context_parallel`); they join
      the FSDP2 shard axis, whose average turns their gradients into one process's.
    """
    if mesh is None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        mesh = _replica_mesh(device, replicate=replicate, cp=cp)
    from torch.distributed.fsdp import fully_shard

    if mesh["cp"].size() > 1:
        split = getattr(model, "context_parallel", None)
        if split is None:
            raise ValueError(
                f"policy.parallelism.cp_size = {mesh['cp'].size()}: context parallelism splits "
                f"the built-in DiT and diffusers flow models, not {type(model).__name__}"
            )
        split(mesh["cp"].get_group())
    shards = _fsdp_mesh(mesh)
    for blocks in _block_lists(model):
        for block in blocks:
            fully_shard(block, mesh=shards)
    fully_shard(model, mesh=shards)
    return mesh


def _replica_mesh(device: torch.device, *, replicate: int, cp: int) -> DeviceMesh:
    """The mesh of every rank, as a language policy replica's (`ParallelDims.build_mesh`,
    without pipeline or tensor parallel): "dp_replicate" x "dp_shard" x "cp", with the flat
    axes "dp" (data-parallel ranks) and "dp_shard_cp" (the FSDP2 shards)."""
    world = dist.get_world_size()
    if world % (replicate * cp):
        raise ValueError(
            f"policy.parallelism.dp_replicate_size ({replicate}) * cp_size ({cp}) must divide "
            f"the replica's ranks ({world})"
        )
    dims = ParallelDims(
        pp=1, dp_replicate=replicate, dp_shard=world // (replicate * cp), cp=cp, tp=1
    )
    return dims.build_mesh(device.type)


def _fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: the shards, or (replicate, shard) for HSDP."""
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard_cp"]
    return mesh["dp_replicate", "dp_shard_cp"]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flat mesh of the data-parallel ranks of `mesh` (a replica's mesh from
    `shard_flow_model`), each with samples of its own: ranks, size and the group that sums
    their metrics (a context-parallel group's ranks share one data-parallel rank)."""
    return mesh["dp"]


def _block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The model's lists of transformer blocks (the built-in DiT's `blocks`, a diffusers
    transformer's `transformer_blocks` or `blocks`, Cosmos 3's `layers`)."""
    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LISTS and len(m) > 0
    ]


BLOCK_LISTS = ("blocks", "transformer_blocks", "layers")


def checkpoint_blocks(model: nn.Module) -> int:
    """Recompute each transformer block's activations in the backward pass instead of keeping
    them (`policy.model_gradient_checkpointing`; torch's composable `checkpoint`, which keeps
    the parameter names, applied before FSDP2 wraps the blocks); how many blocks."""
    from torch.distributed._composable import checkpoint

    count = 0
    for blocks in _block_lists(model):
        for block in blocks:
            checkpoint(block)
            count += 1
    return count


def frozen_copy(model: nn.Module, cfg: Config, *, mesh: DeviceMesh | None) -> nn.Module:
    """A frozen copy of `model` as it is now, sharded like it over `mesh` (FSDP2 modules cannot
    be deep-copied: a fresh model of the same build takes the gathered weights)."""
    if mesh is None:
        return copy.deepcopy(model).requires_grad_(False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    device = next(model.parameters()).device
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    twin = load_flow_model(cfg, seed=cfg.train.seed or 0).to(device)
    twin.load_state_dict(state)
    shard_flow_model(twin, device, mesh=mesh)
    # Forward only: FSDP2 keeps a root's parameters gathered after its forward, for the
    # backward that never comes here; shard them again (soft updates need the shards).
    twin.register_forward_hook(lambda module, args, out: module.reshard())
    return twin.requires_grad_(False)


def save_sharded_flow_model(
    model: nn.Module, cfg: Config, folder: Path, *, mesh: DeviceMesh | None
) -> None:
    """Export `model` (`flow.models.save_flow_model`); sharded over `mesh`, every rank gathers
    and rank 0 writes."""
    if mesh is None:
        save_flow_model(model, folder)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # (a collective)
    if dist.get_rank() == 0:
        whole = load_flow_model(cfg, seed=cfg.train.seed or 0)
        whole.load_state_dict(state)
        save_flow_model(whole, folder)
    dist.barrier()  # (the replica's ranks: rank 0 has written)


def sample_seed(seed: int, step: int, prompt_id: str, k: int) -> int:
    """A seed for sample `k` of the group of `prompt_id` at `step`."""
    digest = hashlib.sha256(f"{seed}:{step}:{prompt_id}:{k}".encode()).digest()
    return int.from_bytes(digest[:6], "little")


def sum_over(values: Tensor, mesh: DeviceMesh) -> Tensor:
    """Sum the CPU tensor `values` over `mesh`'s group in place: staged on this rank's GPU when
    the group is NCCL's (which takes no CPU tensor), directly over gloo."""
    group = mesh.get_group()
    if mesh.device_type == "cuda":
        staged = values.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(staged, group=group)
        values.copy_(staged.cpu())
    else:
        dist.all_reduce(values, group=group)
    return values
