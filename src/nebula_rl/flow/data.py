"""Video/caption datasets of world-model training read into tensors: the clips of cosmos-rl's
local layout (`metas/<stem>.txt` captions, `videos/<stem>.mp4` clips, read with PyAV, or `.npy`
uint8 [T, H, W, 3] where PyAV is not installed, and `t5_xxl/<stem>.pickle` text embeddings
computed offline: a pickled list whose first element is a float array [tokens, width];
`text_embedding/` is read too) and of its diffusers layout, listed by :mod:`nebula_rl.flow.clips`
(which also writes the toy dataset). A clip's window of `num_frames` frames starts at frame 0
(training takes a random window; this reader is deterministic so that rollout and policy see the
same clip). Also the sample grids, GIFs and MP4s a run writes.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from nebula_rl.flow.clips import (
    TOY_PROMPTS,
    VIDEO_FPS,
    Entry,
    caption_layout,
    local_layout,
    make_toy_dataset,
    toy_text_embedding,
    write_mp4,
)

__all__ = [
    "TOY_PROMPTS",
    "VIDEO_FPS",
    "Clip",
    "TextEncoder",
    "clip_batch",
    "clip_pixels",
    "clip_text",
    "frame_grid",
    "make_toy_dataset",
    "prompt_clips",
    "read_caption_folder",
    "read_local_dataset",
    "save_samples",
    "toy_text_embedding",
    "write_gif",
    "write_mp4",
]


@dataclass(frozen=True, slots=True)
class Clip:
    """One entry of a dataset: a caption with its clip and text embeddings, or (a prompt
    dataset's, :mod:`nebula_rl.flow.prompts`) a caption alone, with the shape to sample."""

    stem: str
    caption: str
    video: Tensor | None
    """uint8 [3, T, H, W]; None for a prompt without a clip."""
    text: Tensor | None
    """float32 [tokens, width]; None where the model's text encoder encodes the caption."""
    size: tuple[int, ...] = ()
    """The pixel shape [3, T, H, W] to sample for a prompt without a clip."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The pixel shape [3, T, H, W] of the clip, or of the samples of a prompt."""
        return tuple(self.video.shape) if self.video is not None else self.size

    def samples(self) -> Tensor:
        """The clip as a flow model's sample, float32 [3, T, H, W] in [-1, 1]."""
        if self.video is None:
            raise ValueError(f"{self.stem}: a prompt without a clip has no data to train on")
        return self.video.float() / 127.5 - 1


def write_gif(path: Path, pixels: Tensor) -> None:
    """uint8 samples [rows, n, 3, T, H, W] of T > 1 frames as an animated GIF that loops at
    `VIDEO_FPS`: frame t is the grid of every sample's frame t (:func:`frame_grid`'s layout
    for one frame). Written whole or not at all. GIF stores 256 colours per frame, so the
    colours are approximate (the PNG grid beside it is exact)."""
    frames = [frame_grid(pixels[:, :, :, t : t + 1]) for t in range(pixels.shape[3])]
    _save_whole(
        frames[0],
        path,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=round(1000 / VIDEO_FPS),
        loop=0,
    )


def save_samples(pixels: Tensor, path: Path) -> Path:
    """Write uint8 samples [rows, n, 3, T, H, W] to `path` as a PNG grid (frames side by
    side) and, for videos, beside it as an animated GIF of the same name (each written whole or
    not at all); the PNG's path."""
    path.parent.mkdir(exist_ok=True)
    if pixels.shape[3] > 1:  # (first: whoever sees the PNG finds the GIF there too)
        write_gif(path.with_suffix(".gif"), pixels)
    _save_whole(frame_grid(pixels), path, format="PNG")
    return path


def _save_whole(image: Image.Image, path: Path, **options: Any) -> None:
    """`image.save(path, **options)`, written beside it first and renamed, so `path` is whole
    or absent."""
    partial = path.with_name(f".{path.name}.partial")
    image.save(partial, **options)
    partial.rename(path)


def frame_grid(pixels: Tensor) -> Image.Image:
    """uint8 samples [rows, n, 3, T, H, W] as one image: a row of pixels per row, its `n`
    samples side by side and each sample's frames side by side."""
    rows, n, channels, frames, height, width = pixels.shape
    grid = pixels.permute(0, 4, 1, 3, 5, 2).reshape(rows * height, n * frames * width, channels)
    return Image.fromarray(grid.numpy())


def _read_video(path: Path) -> np.ndarray:
    if path.suffix == ".npy":
        return np.load(path)
    try:
        import av
    except ImportError:
        raise ImportError(
            f"{path}: reading MP4 clips needs PyAV (`pip install av`); or store the clips as "
            "`.npy` arrays"
        ) from None
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def read_local_dataset(root: Path | str, *, num_frames: int, key: str = "dataset") -> list[Clip]:
    """The clips of a local dataset folder, in stem order, each cut to its first `num_frames`
    frames; `key` names the config key that gave `root` in errors."""
    return read_local_entries(local_layout(root, key=key), num_frames=num_frames, key=key)


def read_local_entries(entries: list[Entry], *, num_frames: int, key: str) -> list[Clip]:
    """The clips of entries of the local layout (:func:`~nebula_rl.flow.clips.local_layout`),
    each cut to its first `num_frames` frames."""
    clips = []
    for entry in entries:
        video_path, embed_path = entry.files
        video = _read_video(video_path)
        if video.shape[0] < num_frames:
            raise ValueError(
                f"{key}: {video_path} has {video.shape[0]} frames, fewer than {num_frames}"
            )
        with embed_path.open("rb") as f:
            embedding = np.asarray(pickle.load(f)[0], dtype=np.float32)
        clips.append(
            Clip(
                entry.stem,
                entry.caption,
                torch.from_numpy(np.ascontiguousarray(video[:num_frames])).permute(3, 0, 1, 2),
                torch.from_numpy(embedding),
            )
        )
    return clips


TextEncoder = Callable[[Sequence[str]], Tensor]
"""Captions -> their embeddings [B, L, D], zero past each caption's tokens
(:class:`nebula_rl.flow.text_encoder.PipelineTextEncoder`)."""


def _fit(frame: Image.Image, height: int, width: int) -> np.ndarray:
    """A frame scaled (bicubic) so that it covers `height` x `width`, then centre-cropped."""
    scale = max(height / frame.height, width / frame.width)
    size = (max(width, round(frame.width * scale)), max(height, round(frame.height * scale)))
    frame = frame.convert("RGB").resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return np.asarray(frame.crop((left, top, left + width, top + height)))


def read_caption_folder(
    root: Path | str, *, num_frames: int, height: int, width: int, key: str
) -> list[Clip]:
    """The clips of a folder in cosmos-rl's diffusers layout (`dataset.local_dir`), in stem
    order: `<stem>.json` holds the caption (`"prompt"`) and `<stem>.jpg` / `.png` the image or
    `<stem>.mp4` (`.npy`, uint8 [T, H, W, 3]) the video, its first `num_frames` frames taken;
    each frame scaled to cover `height` x `width` and centre-cropped. The captions carry no
    embeddings: the model's text encoder embeds them (`flow.text_encoder`)."""
    return read_caption_entries(
        caption_layout(root, key=key), num_frames=num_frames, height=height, width=width, key=key
    )


def read_caption_entries(
    entries: list[Entry], *, num_frames: int, height: int, width: int, key: str
) -> list[Clip]:
    """The clips of entries of the diffusers layout (:func:`~nebula_rl.flow.clips.caption_layout`):
    a video's first `num_frames` frames or an image, each frame scaled to cover `height` x
    `width` and centre-cropped."""
    clips = []
    for entry in entries:
        (visual,) = entry.files
        if visual.suffix in (".mp4", ".npy"):
            video = _read_video(visual)
            if video.shape[0] < num_frames:
                raise ValueError(
                    f"{key}: {visual} has {video.shape[0]} frames, fewer than {num_frames}"
                )
            frames = [Image.fromarray(f) for f in video[:num_frames]]
        else:
            if num_frames != 1:
                raise ValueError(
                    f"{key}: {visual} is an image; a video model (policy.diffusers.is_video) "
                    "trains on videos"
                )
            with Image.open(visual) as image:
                frames = [image.copy()]
        pixels = np.stack([_fit(f, height, width) for f in frames])
        video_t = torch.from_numpy(np.ascontiguousarray(pixels)).permute(3, 0, 1, 2)
        clips.append(Clip(entry.stem, entry.caption, video_t, None))
    return clips


def clip_batch(
    clips: list[Clip], encode: TextEncoder | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(samples [B, 3, T, H, W] in [-1, 1], text [B, L, D] zero-padded, mask [B, L]); the text
    of clips without embeddings comes from `encode`."""
    return clip_pixels(clips), *clip_text(clips, encode)


def clip_pixels(clips: list[Clip]) -> Tensor:
    """The clips as samples [B, 3, T, H, W] in [-1, 1]."""
    return torch.stack([c.samples() for c in clips])


def clip_text(clips: list[Clip], encode: TextEncoder | None = None) -> tuple[Tensor, Tensor]:
    """(text [B, L, D] zero-padded, in the embeddings' dtype; mask [B, L]: 1 on a caption's
    nonzero token rows) of `clips`: their stored embeddings, or those `encode` gives their
    captions (all of them for an encoder that `replaces_embeddings`)."""
    texts: list[Tensor | None] = [c.text for c in clips]
    if getattr(encode, "replaces_embeddings", False):  # (Cosmos 3 reads its captions' tokens)
        texts = [None] * len(clips)
    missing = [i for i, t in enumerate(texts) if t is None]
    if missing:
        if encode is None:
            raise ValueError(
                f"{clips[missing[0]].stem}: a prompt without text embeddings needs the model's "
                "text encoder (a diffusers pipeline folder with text_encoder/ and tokenizer/)"
            )
        encoded = encode([clips[i].caption for i in missing])
        for i, row in zip(missing, encoded, strict=True):
            texts[i] = row
    rows = [t for t in texts if t is not None]
    length = max(t.shape[0] for t in rows)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in rows))
    text = torch.zeros(len(rows), length, rows[0].shape[1], dtype=dtype)
    mask = torch.zeros(len(rows), length)
    for i, row in enumerate(rows):
        n = row.shape[0]
        text[i, :n] = row
        mask[i, :n] = (row.abs().sum(dim=1) > 0).float()
    return text, mask


def prompt_clips(entries: list[Entry], *, shape: tuple[int, ...]) -> list[Clip]:
    """Prompt entries (:func:`~nebula_rl.flow.clips.prompt_entries`) as clips without video or
    embeddings, each to be sampled at pixel shape `shape` [3, T, H, W]."""
    return [Clip(e.stem, e.caption, None, None, size=shape) for e in entries]
