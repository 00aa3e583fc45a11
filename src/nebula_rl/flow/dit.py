"""A tiny pixel-space diffusion transformer (DiT, Peebles & Xie 2023) that predicts the
rectified-flow velocity of images and short videos: CPU-sized, for tests and demos.

Input `x` [B, C, T, H, W] (an image is T = 1), the noise level `sigma` [B] in [0, 1], text
embeddings [B, L, D] with their mask [B, L]. Each frame is cut into `patch` x `patch` patches: T x
(H / patch) x (W / patch) tokens with learned positions. The noise level (sinusoidal, then an MLP)
plus the masked mean of the text drive adaLN-Zero modulation of every block; each block
self-attends over all tokens of all frames, cross-attends to the text tokens, then runs an MLP.
The output projection starts at zero, so a fresh model predicts zero velocity.

Context parallelism (`TinyDiT.context_parallel`, `policy.parallelism.cp_size`): the ranks of a
context-parallel group hold the same samples and each runs its contiguous share of the tokens,
whole frames, through the blocks. Self-attention all-gathers the keys and values of every share
(as Llama 3's context parallelism does; a share's queries attend to all tokens), cross-attention
and the MLP are per token, and the output's shares are gathered back, so every rank returns the
whole velocity and computes the same loss. Gathers are differentiable: their backward sums the
gradient over the group and keeps the rank's share. Each rank's parameter gradients then come
from its own tokens, scaled by the group size; summed over the group by FSDP2 (the group's
ranks join its shard axis, which averages), they are the gradient of one process.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nebula_rl.utils.sequence_split import gather_shares, token_share

__all__ = ["TinyDiT", "TinyDiTConfig"]


@dataclass(frozen=True, slots=True)
class TinyDiTConfig:
    """Shape of a :class:`TinyDiT` (sizes in pixels, tokens and channels)."""

    channels: int = 3
    """Pixel channels."""
    frames: int = 1
    """Frames of a sample (1: images)."""
    size: int = 16
    """Height and width of a frame."""
    patch: int = 4
    """Side of a square patch; `size` must be a multiple."""
    width: int = 64
    """Hidden size of the transformer."""
    depth: int = 3
    """Transformer blocks."""
    heads: int = 4
    """Attention heads; `width` must be a multiple."""
    text_dim: int = 32
    """Width of the text embeddings."""
    conditioning: bool = False
    """Takes conditioning frames (image/video-to-video): a learned embedding, zero at first, is
    added to the tokens of each given frame."""

    def to_dict(self) -> dict[str, int | bool]:
        """The fields, for a saved model's config."""
        return asdict(self)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def sinusoidal(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal features [B, dim] of the scalars `t` [B] (transformers' positional form)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000) * torch.arange(half, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm_cross = nn.LayerNorm(width, eps=1e-6)
        self.q_cross = nn.Linear(width, width)
        self.kv_cross = nn.Linear(width, 2 * width)
        self.proj_cross = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
        )
        self.ada = nn.Linear(width, 6 * width)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)
        self.cp_group: dist.ProcessGroup | None = None
        """Context-parallel group: `x` is this rank's share of the tokens (None: all)."""

    def _heads(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.heads, -1).transpose(1, 2)

    def _merge(self, x: Tensor) -> Tensor:
        b, _, n, _ = x.shape
        return x.transpose(1, 2).reshape(b, n, -1)

    def forward(self, x: Tensor, cond: Tensor, text: Tensor, text_mask: Tensor) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(cond)).chunk(6, dim=-1)
        q, k, v = self.qkv(_modulate(self.norm1(x), shift1, scale1)).chunk(3, dim=-1)
        # (every share's keys and values)
        k, v = gather_shares(k, self.cp_group), gather_shares(v, self.cp_group)
        attn = F.scaled_dot_product_attention(self._heads(q), self._heads(k), self._heads(v))
        x = x + gate1[:, None] * self.proj(self._merge(attn))
        kc, vc = self.kv_cross(text).chunk(2, dim=-1)
        mask = text_mask[:, None, None, :]
        cross = F.scaled_dot_product_attention(
            self._heads(self.q_cross(self.norm_cross(x))),
            self._heads(kc),
            self._heads(vc),
            attn_mask=mask,
        )
        x = x + self.proj_cross(self._merge(cross))
        return x + gate2[:, None] * self.mlp(_modulate(self.norm2(x), shift2, scale2))


def autocast(dtype: torch.dtype, x: Tensor) -> contextlib.AbstractContextManager[object]:
    """Autocast to `dtype` on `x`'s device, or nothing at float32 (a flow model's mixed
    precision)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=x.device.type, dtype=dtype)


class TinyDiT(nn.Module):
    """Velocity `v = model(x, sigma, text, text_mask)` of a rectified flow
    `x_sigma = (1 - sigma) x0 + sigma noise` (so `v` estimates `noise - x0`)."""

    def __init__(self, config: TinyDiTConfig) -> None:
        super().__init__()
        c = config
        if c.size % c.patch or c.width % c.heads:
            raise ValueError("TinyDiT: size must be a multiple of patch, width of heads")
        self.config = c
        side = c.size // c.patch
        self.patch_embed = nn.Linear(c.channels * c.patch**2, c.width)
        self.pos = nn.Parameter(torch.randn(1, c.frames * side * side, c.width) * 0.02)
        self.t_embed = nn.Sequential(
            nn.Linear(c.width, c.width), nn.SiLU(), nn.Linear(c.width, c.width)
        )
        self.text_proj = nn.Linear(c.text_dim, c.width)
        self.pool_proj = nn.Linear(c.text_dim, c.width)
        self.blocks = nn.ModuleList(_Block(c.width, c.heads) for _ in range(c.depth))
        self.norm_out = nn.LayerNorm(c.width, elementwise_affine=False, eps=1e-6)
        if c.conditioning:
            self.cond_embed = nn.Parameter(torch.zeros(1, 1, c.width))
        self.ada_out = nn.Linear(c.width, 2 * c.width)
        self.out = nn.Linear(c.width, c.channels * c.patch**2)
        for layer in (self.ada_out, self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    compute_dtype: torch.dtype = torch.float32
    """The dtype the forward computes in (`train.param_dtype`): below float32, under autocast;
    the velocity comes back in the input's dtype."""

    cp_group: dist.ProcessGroup | None = None
    """The context-parallel group the tokens are split over (None: not split)."""

    def context_parallel(self, group: dist.ProcessGroup) -> None:
        """Split the tokens of every sample over `group`'s ranks, whole frames each (they must
        divide the frames); each rank of the group must be given the same inputs."""
        size = dist.get_world_size(group)
        if self.config.frames % size:
            raise ValueError(
                f"policy.parallelism.cp_size ({size}) must divide the frames of a sample "
                f"({self.config.frames}): context parallelism splits a clip by whole frames"
            )
        self.cp_group = group
        for block in self.blocks:
            assert isinstance(block, _Block)
            block.cp_group = group

    def forward(
        self,
        x: Tensor,
        sigma: Tensor,
        text: Tensor,
        text_mask: Tensor,
        condition: Tensor | None = None,
    ) -> Tensor:
        """`x` [B, C, T, H, W], `sigma` [B], `text` [B, L, D], `text_mask` [B, L] (1 for a
        token), `condition` [B, T] (1 for a given conditioning frame, whose pixels `x` holds
        clean) -> velocity [B, C, T, H, W]."""
        with autocast(self.compute_dtype, x):
            return self._velocity(x, sigma, text, text_mask, condition).to(x.dtype)

    def _velocity(
        self, x: Tensor, sigma: Tensor, text: Tensor, text_mask: Tensor, condition: Tensor | None
    ) -> Tensor:
        c = self.config
        b, channels, frames, height, width = x.shape
        if (channels, frames, height, width) != (c.channels, c.frames, c.size, c.size):
            raise ValueError(
                f"TinyDiT: input {tuple(x.shape[1:])}, built for "
                f"{(c.channels, c.frames, c.size, c.size)}"
            )
        p, side = c.patch, c.size // c.patch
        tokens = (
            x.reshape(b, channels, frames, side, p, side, p)
            .permute(0, 2, 3, 5, 1, 4, 6)
            .reshape(b, frames * side * side, channels * p * p)
        )
        pos: Tensor = self.pos
        given = None
        if condition is not None:
            if not c.conditioning:
                raise ValueError(
                    "TinyDiT: conditioning frames given to a model built without them "
                    "(TinyDiTConfig.conditioning)"
                )
            given = condition.to(x.dtype).repeat_interleave(side * side, dim=1)[..., None]
        if self.cp_group is not None:  # (this rank's share: whole frames)
            share = token_share(tokens.shape[1], self.cp_group)
            tokens, pos = tokens[:, share], pos[:, share]
            given = None if given is None else given[:, share]
        h = self.patch_embed(tokens) + pos
        if given is not None:
            h = h + given * self.cond_embed
        mask = text_mask.to(text.dtype)
        pooled = (text * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        cond = self.t_embed(sinusoidal(sigma * 1000, c.width)) + self.pool_proj(pooled)
        words = self.text_proj(text)
        # A row without text (the unconditional branch of guidance) attends to its first
        # embedding, zeros by convention, rather than to nothing (which gives NaN).
        keep = text_mask.bool().clone()
        keep[:, 0] |= ~keep.any(dim=1)
        for block in self.blocks:
            h = block(h, cond, words, keep)
        shift, scale = self.ada_out(F.silu(cond)).chunk(2, dim=-1)
        out = gather_shares(self.out(_modulate(self.norm_out(h), shift, scale)), self.cp_group)
        return (
            out.reshape(b, frames, side, side, channels, p, p)
            .permute(0, 4, 1, 2, 5, 3, 6)
            .reshape(b, channels, frames, height, width)
        )
