"""Video/caption datasets of world-model training, in cosmos-rl's local layout, and the toy one
the tests and the demo generate.

The layout (`datasets/<name>/`): `metas/<stem>.txt` holds a clip's caption, `videos/<stem>.mp4`
the clip (read with PyAV; `videos/<stem>.npy`, uint8 [T, H, W, 3], where PyAV is not installed)
and `t5_xxl/<stem>.pickle` its text embeddings, computed offline: a pickled list whose first
element is a float array [tokens, width] (`text_embedding/` is read too). A clip's window of
`num_frames` frames starts at frame 0 (training takes a random window; this reader is
deterministic so that rollout and policy see the same clip).

The toy dataset: :data:`TOY_PROMPTS` ("a red square", ...), each a coloured shape on a noisy dark
background, drifting a little from frame to frame; its "text embeddings" are frozen random
vectors per word (:func:`toy_text_embedding`), standing in for a text encoder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from nebula_rl.rewards.visual import COLOURS, shape_mask

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
    "read_caption_folder",
    "read_local_dataset",
    "save_samples",
    "toy_text_embedding",
    "write_gif",
    "write_mp4",
]

TOY_PROMPTS = (
    "a red square",
    "a blue circle",
    "a green bar",
    "a yellow square",
    "a cyan circle",
    "a magenta bar",
    "a red circle",
    "a blue bar",
)
_EMBED_DIRS = ("t5_xxl", "text_embedding")


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


def toy_text_embedding(caption: str, *, tokens: int = 4, width: int = 32) -> np.ndarray:
    """Frozen random embeddings [tokens, width] of a caption's words (zeros past its words):
    each word's vector is drawn from a generator seeded by the word's hash."""
    out = np.zeros((tokens, width), dtype=np.float32)
    for i, word in enumerate(caption.lower().split()[:tokens]):
        seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "little")
        out[i] = np.random.default_rng(seed).standard_normal(width).astype(np.float32)
    return out


def _toy_clip(caption: str, rng: np.random.Generator, *, frames: int, size: int) -> np.ndarray:
    """uint8 [T, H, W, 3]: the caption's shape in its colour over a noisy dark background."""
    colour = next(COLOURS[w] for w in caption.split() if w in COLOURS)
    shape = next(w for w in caption.split() if w in ("square", "circle", "bar"))
    centre = rng.uniform(0.4, 0.6, size=2)
    drift = rng.uniform(-0.03, 0.03, size=2)
    video = np.empty((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        background = rng.uniform(0, 40, size=(size, size, 3))
        cy, cx = centre + t * drift
        mask = shape_mask(shape, size, centre=(float(cy), float(cx))).numpy()
        frame = background.copy()
        frame[mask] = np.array(colour) * 220 + 20
        video[t] = frame.round().astype(np.uint8)
    return video


def make_toy_dataset(
    root: Path | str,
    *,
    clips_per_prompt: int = 4,
    frames: int = 2,
    size: int = 16,
    seed: int = 0,
    mp4: bool = False,
) -> Path:
    """Write the toy dataset under `root` (cosmos-rl's local layout); clips as `.npy`, or as MP4
    with `mp4` (needs PyAV; at 16 x 16 pixels the codec's halved colour resolution visibly
    smears the shapes, so the demo keeps the exact `.npy`). Returns `root`."""
    root = Path(root)
    for folder in ("metas", "videos", "t5_xxl"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for p, caption in enumerate(TOY_PROMPTS):
        for k in range(clips_per_prompt):
            stem = f"clip_{p:02d}_{k:02d}"
            video = _toy_clip(caption, rng, frames=frames, size=size)
            (root / "metas" / f"{stem}.txt").write_text(caption + "\n")
            if mp4:
                write_mp4(root / "videos" / f"{stem}.mp4", video)
            else:
                np.save(root / "videos" / f"{stem}.npy", video)
            with (root / "t5_xxl" / f"{stem}.pickle").open("wb") as f:
                pickle.dump([toy_text_embedding(caption)], f)
    return root


VIDEO_FPS = 16
"""Frames per second of the videos a run writes (sample MP4s and animated grids)."""


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


def write_mp4(path: Path, video: np.ndarray) -> None:
    """A lossless-ish MP4 (mpeg4 at top quality) of uint8 [T, H, W, 3] frames at
    `VIDEO_FPS`."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.height, stream.width = video.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "1"}
        for frame in video:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


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
    root = Path(root)
    metas = sorted((root / "metas").glob("*.txt"))
    if not metas:
        raise ValueError(f"{key}: {root} has no metas/*.txt (cosmos-rl's local dataset layout)")
    clips = []
    for meta in metas:
        stem = meta.stem
        video_path = next(
            (p for ext in (".mp4", ".npy") if (p := root / "videos" / f"{stem}{ext}").exists()),
            None,
        )
        embed_path = next(
            (p for d in _EMBED_DIRS if (p := root / d / f"{stem}.pickle").exists()), None
        )
        if video_path is None or embed_path is None:
            missing = "videos/<stem>.mp4 or .npy" if video_path is None else "t5_xxl/<stem>.pickle"
            raise ValueError(f"{key}: {root}: clip {stem!r} has no {missing}")
        video = _read_video(video_path)
        if video.shape[0] < num_frames:
            raise ValueError(
                f"{key}: {video_path} has {video.shape[0]} frames, fewer than {num_frames}"
            )
        with embed_path.open("rb") as f:
            embedding = np.asarray(pickle.load(f)[0], dtype=np.float32)
        clips.append(
            Clip(
                stem,
                meta.read_text().strip(),
                torch.from_numpy(np.ascontiguousarray(video[:num_frames])).permute(3, 0, 1, 2),
                torch.from_numpy(embedding),
            )
        )
    return clips


TextEncoder = Callable[[Sequence[str]], Tensor]
"""Captions -> their embeddings [B, L, D], zero past each caption's tokens
(:class:`nebula_rl.flow.text_encoder.PipelineTextEncoder`)."""


_VISUALS = (".jpg", ".jpeg", ".png", ".mp4", ".npy")


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
    root = Path(root)
    metas = sorted(root.glob("*.json"))
    if not metas:
        raise ValueError(
            f"{key}: {root} has no <stem>.json captions (cosmos-rl's diffusers layout)"
        )
    clips = []
    for meta in metas:
        try:
            caption = str(json.loads(meta.read_text())["prompt"]).strip()
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f'{key}: {meta} must be an object with a "prompt" ({err})') from err
        visual = next((p for ext in _VISUALS if (p := meta.with_suffix(ext)).exists()), None)
        if visual is None:
            raise ValueError(f"{key}: {meta.stem!r} has no {' / '.join(_VISUALS)} beside {meta}")
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
        clips.append(Clip(meta.stem, caption, video_t, None))
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
    captions."""
    texts: list[Tensor | None] = [c.text for c in clips]
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
