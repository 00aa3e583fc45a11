"""Multimodal prompts for the built-in engine: what a Qwen-VL model's prefill takes besides
token ids, computed with the model's own modules.

A vision-language prompt differs from a text prompt only until its last token: the vision tower
turns its images and videos into embeddings that replace the pad tokens' rows (Qwen3-VL also adds
"DeepStack" features of early vision blocks to the hidden states of the first decoder layers at
those rows), and M-RoPE gives every token three position indices (time, height, width), which the
model's `get_rope_index` computes. After the prompt, text tokens have equal indices on the three
axes, `i + delta` for the token at cache position `i`, where `delta` (<= 0 for images: an image's
tokens span fewer positions than they count) is per prompt. So decoding stays ordinary decoding
over the same KV cache; only its rotary position is offset by the prompt's delta.

The engine calls :func:`embed_prompts` at admission; the request carries the prompt's pixels and
grids as `data.vision.VisionProcessor` made them (the same tensors the policy's forward gets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nebula_rl.data.vision import VisionInputs, media_kwargs

__all__ = ["PromptEmbeddings", "embed_prompts", "is_multimodal", "language_model"]


def is_multimodal(model: torch.nn.Module) -> bool:
    """Whether `model` is a Qwen-VL-style vision-language model (a vision tower `model.visual`
    in front of a language model `model.language_model`)."""
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "visual") and hasattr(inner, "language_model")


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embeddings, layers, norm, rotary embedding): a vision-language model's
    language model, a causal LM's base model."""
    base = model.get_submodule("model.language_model") if is_multimodal(model) else model.base_model
    assert isinstance(base, torch.nn.Module)
    return base


@dataclass(frozen=True, slots=True)
class PromptEmbeddings:
    """The prefill inputs of U right-padded prompts of length P (rows without media included)."""

    embeds: torch.Tensor
    """[U, P, hidden] token embeddings, vision embeddings at the media tokens."""
    positions: torch.Tensor
    """[3, U, P] M-RoPE position indices (time, height, width)."""
    deltas: torch.Tensor
    """[U] rotary offset of the tokens after each prompt: position i rotates as i + delta."""
    visual_mask: torch.Tensor | None
    """[U, P] bool, the media tokens (models with DeepStack features only)."""
    deepstack: tuple[torch.Tensor, ...]
    """Per early decoder layer, [media tokens, hidden] added to its output at `visual_mask`."""


def embed_prompts(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    media: Sequence[VisionInputs | None],
) -> PromptEmbeddings:
    """Run the vision tower over the media of `tokens` [U, P] (right-padded to P; `lengths` [U]
    real tokens; `media[u]`: row u's pixels and grids, None for a text row) and build its prefill
    inputs, as the model's own forward does: the same vision calls, scatter and position rule."""
    inner: Any = model.get_submodule("model")
    config: Any = model.config
    real = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]
    kwargs = {
        k: v.to(tokens.device)
        for k, v in media_kwargs(
            media,
            tokens,
            image_token_id=int(config.image_token_id),
            video_token_id=int(config.video_token_id),
            attention_mask=real,
        ).items()
    }
    embeds = inner.get_input_embeddings()(tokens)
    masks: list[torch.Tensor] = []
    features: list[list[torch.Tensor]] = []
    for kind, token_id in (("image", config.image_token_id), ("video", config.video_token_id)):
        key = "pixel_values" if kind == "image" else "pixel_values_videos"
        if key not in kwargs:
            continue
        encode = inner.get_image_features if kind == "image" else inner.get_video_features
        out = encode(kwargs[key], kwargs[f"{kind}_grid_thw"], return_dict=True)
        found = torch.cat(out.pooler_output).to(embeds.dtype)
        mask = (tokens == int(token_id)) & real
        # (the engine refuses a request whose media tokens its grids do not account for)
        assert int(mask.sum()) == found.shape[0], f"{kind} tokens and embeddings differ"
        embeds = embeds.masked_scatter(mask[..., None], found)
        masks.append(mask)
        features.append(
            [torch.cat(f).to(embeds.dtype) for f in getattr(out, "deepstack_features", None) or ()]
        )
    rope: dict[str, Any] = {
        k: kwargs[k]
        for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
        if k in kwargs
    }
    positions, deltas = inner.get_rope_index(
        tokens, mm_token_type_ids=kwargs["mm_token_type_ids"], attention_mask=real.long(), **rope
    )
    visual_mask, deepstack = None, ()
    if any(features):  # Qwen3-VL: one joint row per media token, in sequence order
        visual_mask = torch.stack(masks).any(0)
        layers = []
        for layer in range(len(features[0])):
            joint = embeds.new_zeros(int(visual_mask.sum()), embeds.shape[-1])
            for mask, feats in zip(masks, features, strict=True):
                joint[mask[visual_mask]] = feats[layer]
            layers.append(joint)
        deepstack = tuple(layers)
    return PromptEmbeddings(embeds, positions, deltas.view(-1), visual_mask, deepstack)
