"""Splitting a flow model over ranks with FSDP2, for the runtime's policy replicas
(`flow.runtime`) and the colocated one-job loop (`flow.job`): the sharding (FSDP2 over
`dp_shard_size` ranks, or HSDP: `dp_replicate_size` replicas of such shards), frozen copies
sharded alike, an export that gathers, and the per-sample seeds that make a split step equal
one process's.

Every rank is a data-parallel rank with its own samples: `dp_mesh` gives the flat mesh of all of
them (rank, size, group), whichever of the two layouts shards the weights.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nebula_rl.config import Config
from nebula_rl.flow.models import load_flow_model, save_flow_model

__all__ = [
    "BLOCK_LISTS",
    "checkpoint_blocks",
    "dp_mesh",
    "frozen_copy",
    "sample_seed",
    "save_sharded_flow_model",
    "shard_flow_model",
]


def shard_flow_model(
    model: nn.Module, device: torch.device, *, replicate: int = 1, mesh: DeviceMesh | None = None
) -> DeviceMesh | None:
    """Split `model` over this replica's ranks with FSDP2 (each block a unit, then the root),
    when the replica has several: over `mesh`, by default a new one of every rank, sharded over
    all of them or, with `replicate` > 1 (`policy.parallelism.dp_replicate_size`), HSDP:
    `replicate` copies, each sharded over world / `replicate` ranks (gradients reduce-scattered
    within a copy, then all-reduced between copies). The mesh (None: one process)."""
    if mesh is None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        world = dist.get_world_size()
        if world % replicate:
            raise ValueError(
                f"policy.parallelism.dp_replicate_size ({replicate}) must divide the replica's "
                f"ranks ({world})"
            )
        if replicate == 1:
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
        else:
            mesh = init_device_mesh(
                device.type,
                (replicate, world // replicate),
                mesh_dim_names=("dp_replicate", "dp_shard"),
            )
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
    from torch.distributed.fsdp import fully_shard

    for blocks in _block_lists(model):
        for block in blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flat mesh of every data-parallel rank of `mesh` (a sharding mesh of
    `shard_flow_model`): ranks, size and the group that sums their metrics."""
    return mesh if mesh.ndim == 1 else mesh["dp"]


def _block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The model's lists of transformer blocks (the built-in DiT's `blocks`, a diffusers
    transformer's `transformer_blocks` or `blocks`)."""
    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LISTS and len(m) > 0
    ]


BLOCK_LISTS = ("blocks", "transformer_blocks")


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
    dist.barrier(group=dp_mesh(mesh).get_group())


def sample_seed(seed: int, step: int, prompt_id: str, k: int) -> int:
    """A seed for sample `k` of the group of `prompt_id` at `step`."""
    digest = hashlib.sha256(f"{seed}:{step}:{prompt_id}:{k}".encode()).digest()
    return int.from_bytes(digest[:6], "little")
