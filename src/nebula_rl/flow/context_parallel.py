"""Context parallelism of flow models along the frame axis (`policy.parallelism.cp_size`).

The ranks of a context-parallel group hold the same samples; each runs a contiguous share of
every sample's tokens, whole frames, through the transformer blocks. Everything a block does per
token (norms, MLPs, cross-attention to the text) needs nothing else; self-attention all-gathers
the keys and values of every share, so a share's queries attend to all tokens (Llama 3's
context parallelism), and the output's shares are gathered back: every rank returns the whole
velocity and computes the same loss.

Gathers are differentiable (`sequence_split.gather_shares`): the backward sums the gradient over the
group and keeps the rank's share. A rank's parameter gradients then come from its own tokens,
scaled by the group size; FSDP2, whose shard axis the group's ranks join, averages them into the
gradient of one process.

The built-in DiT splits itself (`TinyDiT.context_parallel`). A diffusers transformer is split
from outside by :func:`split_diffusers_transformer`, with forward hooks on its own modules: the
patch embedding's output keeps this rank's frames, the positional embeddings (rotary, learned)
and a per-token timestep (Wan 2.2 TI2V's) this rank's tokens, the output projection gathers
every rank's, and each block's
self-attention module runs under `sequence_split.GatheredAttention`, a torch-function mode that hands
its one `scaled_dot_product_attention` call every share's keys and values. The rotary tables
stay whole per position, so a split model computes what the whole one does. (diffusers' own
`enable_parallelism` is not used: Cosmos-Predict2.5's attention processors do not take its
parallel config, and its native backend runs Ulysses only, which needs the heads to divide.)

Cosmos 3's generator (`Cosmos3OmniTransformer`: one packed sequence a sample, the prompt's
tokens through the causal understanding pathway, the clip's latent patches through the
generation pathway) offers seams for this, `_cp_shard_fn` and `_cp_gather_fn`, around its layer
stack: the split keeps every rank's prompt whole (a few hundred tokens beside thousands of
patches) and an equal share of the patches with their rotary rows (not whole frames: its
positions are per token), and gathers the patches' outputs back. In each layer the prompt's
causal attention runs whole on every rank; the patches' attention (to the prompt's keys and
every patch's) gathers only the patches' keys and values (`GatheredAttention`'s `prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch.distributed as dist
from torch import Tensor, nn

from nebula_rl.flow.cosmos3 import COSMOS3_CLASS
from nebula_rl.utils.sequence_split import GatheredAttention, gather_shares, token_share

__all__ = ["CP_CLASSES", "split_diffusers_transformer"]

KEY = "policy.parallelism.cp_size"


@dataclass(frozen=True, slots=True)
class _Plan:
    """Where a diffusers transformer class is split: the patch embedding (its output's frame
    axis), the positional embeddings (module name -> token axis of each output), the output
    projection (gathered on axis 1), the self-attention module of each block, and the
    position of a per-token timestep [B, tokens] among the forward's arguments (None: it
    takes one per sample)."""

    embed: str
    frame_dim: int
    positions: dict[str, int]
    out: str
    blocks: str
    attention: str
    timestep: int | None = None


_PLANS = {
    "CosmosTransformer3DModel": _Plan(
        embed="patch_embed",  # [B, T, H, W, C], flattened to [B, THW, C]
        frame_dim=1,
        positions={"rope": 0, "learnable_pos_embed": 1},  # ([THW, D] x 2), [B, THW, C]
        out="proj_out",
        blocks="transformer_blocks",
        attention="attn1",
    ),
    "WanTransformer3DModel": _Plan(
        embed="patch_embedding",  # [B, C, T, H, W], flattened to [B, THW, C]
        frame_dim=2,
        positions={"rope": 1},  # [1, THW, 1, D] x 2
        out="proj_out",
        blocks="blocks",
        attention="attn1",
        timestep=1,  # (Wan 2.2 TI2V's per-token timesteps)
    ),
}

CP_CLASSES = (*_PLANS, COSMOS3_CLASS)
"""The diffusers transformer classes context parallelism splits (SD3 makes images: one frame)."""


def split_diffusers_transformer(transformer: nn.Module, group: dist.ProcessGroup) -> None:
    """Split `transformer` (one of :data:`CP_CLASSES`) over `group`'s ranks along the frame
    axis with forward hooks (see the module docstring); its frames after patching must be a
    multiple of the group's size (Cosmos 3's generator: its latent patches, split through its
    own seams)."""
    kind = type(transformer).__name__
    if kind == COSMOS3_CLASS:
        _split_cosmos3(transformer, group)
        return
    plan = _PLANS.get(kind)
    if plan is None:
        raise ValueError(
            f"{KEY} = {dist.get_world_size(group)}: context parallelism splits clips by frames; "
            f"a {kind} is not split (it runs the built-in DiT, "
            f"{', '.join(CP_CLASSES)})"
        )
    size = dist.get_world_size(group)

    def keep_frames(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        frames = out.shape[plan.frame_dim]
        if frames % size:
            raise ValueError(
                f"{KEY} ({size}) must divide the frames the {kind} patches a sample into "
                f"({frames}): context parallelism splits a clip by whole frames"
            )
        return _narrow(out, plan.frame_dim, group)

    def keep_tokens(dim: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> Any:
            if isinstance(out, tuple):
                return tuple(_narrow(o, dim, group) for o in out)
            return _narrow(out, dim, group)

        return hook

    getattr(transformer, plan.embed).register_forward_hook(keep_frames)
    if plan.timestep is not None:
        transformer.register_forward_pre_hook(
            _keep_timestep_tokens(plan.timestep, group), with_kwargs=True
        )
    for name, dim in plan.positions.items():
        module = getattr(transformer, name, None)
        if module is not None:
            module.register_forward_hook(keep_tokens(dim))
    getattr(transformer, plan.out).register_forward_hook(
        lambda module, args, out: gather_shares(out, group, dim=1)
    )
    for block in getattr(transformer, plan.blocks):
        _gather_keys_values(getattr(block, plan.attention), group)


def _keep_timestep_tokens(index: int, group: dist.ProcessGroup) -> Any:
    """A forward pre-hook that keeps this rank's tokens of a per-token timestep [B, tokens],
    the forward's argument `index` (or keyword `timestep`)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        given = args[index] if len(args) > index else kwargs.get("timestep")
        if not isinstance(given, Tensor) or given.ndim != 2:
            return None
        share = _narrow(given, 1, group)
        if len(args) > index:
            return (*args[:index], share, *args[index + 1 :]), kwargs
        return args, {**kwargs, "timestep": share}

    return hook


def _split_cosmos3(transformer: nn.Module, group: dist.ProcessGroup) -> None:
    """Split a `Cosmos3OmniTransformer`'s generated tokens over `group` through its own seams
    (see the module docstring)."""
    size = dist.get_world_size(group)

    def shard(und: Tensor, gen: Tensor, rotary: tuple[Tensor, ...]) -> Any:
        if gen.shape[0] % size:
            raise ValueError(
                f"{KEY} ({size}) must divide the {gen.shape[0]} latent patches of a sample: "
                "context parallelism gives each rank an equal share of them"
            )
        cos_und, sin_und, cos_gen, sin_gen = rotary
        rows = (cos_und, sin_und, _narrow(cos_gen, 0, group), _narrow(sin_gen, 0, group))
        return und, _narrow(gen, 0, group), rows

    def gather(und: Tensor, gen: Tensor) -> tuple[Tensor, Tensor]:
        return und, gather_shares(gen, group, dim=0)

    model = cast(Any, transformer)
    model._cp_shard_fn = shard  # (instance attributes over the class's None)
    model._cp_gather_fn = gather
    for layer in model.layers:
        _gather_keys_values(layer.self_attn, group, prompt_first=True)


def _narrow(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    share = token_share(x.shape[dim], group)
    return x.narrow(dim, share.start, share.stop - share.start)


def _gather_keys_values(
    attention: nn.Module, group: dist.ProcessGroup, *, prompt_first: bool = False
) -> None:
    """Run `attention` (a self-attention module) under `GatheredAttention`, checking
    that its one attention call over split tokens went through it (an attention backend other
    than diffusers' native one would skip `scaled_dot_product_attention` and attend to this
    share alone). `prompt_first`: Cosmos 3's attention, whose first argument is the whole
    prompt, whose keys lead the patches' call."""
    modes: list[GatheredAttention] = []

    def enter(module: nn.Module, args: Any) -> None:
        if prompt_first:
            mode = GatheredAttention(group, prefix=int(args[0].shape[0]), whole_causal=True)
        else:
            mode = GatheredAttention(group)
        mode.__enter__()
        modes.append(mode)

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        mode = modes.pop()
        mode.__exit__(None, None, None)
        if out is not None and mode.calls != 1:  # (None: the forward raised)
            raise RuntimeError(
                f"{KEY}: {type(module).__name__}'s self-attention made {mode.calls} "
                "scaled_dot_product_attention calls, not 1: context parallelism needs diffusers' "
                "native attention backend (unset DIFFUSERS_ATTN_BACKEND)"
            )

    attention.register_forward_pre_hook(enter)
    attention.register_forward_hook(leave, always_call=True)
