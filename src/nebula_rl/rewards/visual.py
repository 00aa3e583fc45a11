"""Rewards of generated images and videos that need no download, for world-model RL tests and
demos; each scores a batch at once.

A reward is `fn(pixels, prompts) -> list[float]`: `pixels` uint8 [B, C, T, H, W] (RGB, an image
is T = 1), `prompts` the B texts they were generated from.

- `brightness`: the mean pixel in [0, 1]. Monotone and the fastest to learn.
- `colour_match`: the prompt names a colour (:data:`COLOURS`); the mean of that colour's
  channels minus the mean of the others, in [-1, 1] (0 when the prompt names none).
- `jpeg_compressibility`: FlowGRPO's compression reward, `-(JPEG size in kB at quality 95) / 500`,
  per frame, averaged over frames.
- `prompt_alignment`: a toy alignment score: `colour_match` of the prompt's colour plus, when the
  prompt names a shape of the toy dataset (`square`, `circle`, `bar`), how much more the shape's
  own mask is lit than the rest of the frame.

`pixels_from_samples` turns a flow model's samples in [-1, 1] into such pixels.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from nebula_rl.rewards.shapes import COLOURS, SHAPES, shape_mask

__all__ = [
    "COLOURS",
    "VISUAL_REWARDS",
    "VisualReward",
    "brightness",
    "check_pixels",
    "colour_match",
    "jpeg_compressibility",
    "pixels_from_samples",
    "prompt_alignment",
]

VisualReward = Callable[[Tensor, Sequence[str]], list[float]]


def pixels_from_samples(samples: Tensor) -> Tensor:
    """Samples in [-1, 1] (float, any device) as uint8 pixels on the CPU."""
    return ((samples.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def check_pixels(pixels: Tensor, prompts: Sequence[str], *, who: str = "visual rewards") -> None:
    """Raise unless `pixels` are uint8 RGB [B, 3, T, H, W] with one prompt per sample (`who`
    names the reward in the error)."""
    if pixels.dtype != torch.uint8 or pixels.dim() != 5 or pixels.shape[1] != 3:
        raise ValueError(
            f"{who} take uint8 RGB pixels [B, 3, T, H, W], got {pixels.dtype} {tuple(pixels.shape)}"
        )
    if len(prompts) != pixels.shape[0]:
        raise ValueError(f"{pixels.shape[0]} samples but {len(prompts)} prompts")


def _check(pixels: Tensor, prompts: Sequence[str]) -> Tensor:
    check_pixels(pixels, prompts)
    return pixels.float() / 255


def brightness(pixels: Tensor, prompts: Sequence[str]) -> list[float]:
    """The mean pixel of each sample, in [0, 1]."""
    return _check(pixels, prompts).flatten(1).mean(dim=1).tolist()


def _colour_of(prompt: str) -> tuple[int, int, int] | None:
    words = re.findall(r"[a-z]+", prompt.lower())
    return next((COLOURS[w] for w in words if w in COLOURS), None)


def _colour_scores(x: Tensor, prompts: Sequence[str]) -> list[float]:
    channels = x.mean(dim=(2, 3, 4))  # [B, 3]
    scores = []
    for row, prompt in zip(channels, prompts, strict=True):
        colour = _colour_of(prompt)
        if colour is None:
            scores.append(0.0)
            continue
        on = torch.tensor(colour, dtype=torch.bool)
        off = row[~on].mean() if (~on).any() else row.new_zeros(())
        scores.append(float(row[on].mean() - off))
    return scores


def colour_match(pixels: Tensor, prompts: Sequence[str]) -> list[float]:
    """How much the prompt's colour dominates each sample, in [-1, 1]."""
    return _colour_scores(_check(pixels, prompts), prompts)


def jpeg_compressibility(pixels: Tensor, prompts: Sequence[str]) -> list[float]:
    """`-(JPEG kB at quality 95) / 500` of each sample's frames, averaged over its frames."""
    from PIL import Image

    _check(pixels, prompts)
    scores = []
    for sample in pixels:
        sizes = []
        for frame in sample.permute(1, 2, 3, 0):  # [T, H, W, C]
            buffer = io.BytesIO()
            Image.fromarray(frame.numpy()).save(buffer, format="JPEG", quality=95)
            sizes.append(buffer.tell() / 1000)
        scores.append(-sum(sizes) / len(sizes) / 500)
    return scores


def prompt_alignment(pixels: Tensor, prompts: Sequence[str]) -> list[float]:
    """`colour_match` plus, for a prompt naming a shape, the mean brightness inside the centred
    shape's mask minus outside it."""
    x = _check(pixels, prompts)
    scores = _colour_scores(x, prompts)
    for i, prompt in enumerate(prompts):
        shape = next((s for s in SHAPES if s in prompt.lower()), None)
        if shape is None:
            continue
        mask = torch.from_numpy(shape_mask(shape, x.shape[-1]))
        lit = x[i].mean(dim=(0, 1))  # [H, W]
        scores[i] += float(lit[mask].mean() - lit[~mask].mean())
    return scores


VISUAL_REWARDS: dict[str, VisualReward] = {
    "brightness": brightness,
    "colour_match": colour_match,
    "jpeg_compressibility": jpeg_compressibility,
    "prompt_alignment": prompt_alignment,
}
"""Visual rewards by the name a config or a reward-service request gives."""
