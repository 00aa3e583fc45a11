"""A world-model dataset as files and rows, torch-free (numpy and files only): what the
controller, which loads no torch, needs to hand out a world-model job's rows, and what the
readers of :mod:`nebula_rl.flow.data` (which load the pixels) list first, so that both see the
same rows in the same order.

- The toy dataset (`builtin:toy_video`): :data:`TOY_PROMPTS` ("a red square", ...), each a
  coloured shape on a noisy dark background, drifting a little from frame to frame, its "text
  embeddings" frozen random vectors per word (:func:`toy_text_embedding`), standing in for a text
  encoder; :func:`make_toy_dataset` writes it in cosmos-rl's local layout.
- :func:`local_layout`: cosmos-rl's local layout (`metas/<stem>.txt` captions,
  `videos/<stem>.mp4` or `.npy` clips, `t5_xxl/<stem>.pickle` embeddings) as entries;
  :func:`caption_layout`: its diffusers layout (`<stem>.json` captions beside `<stem>.jpg`,
  `.png`, `.mp4` or `.npy`).
- :func:`prompt_entries`: a prompt set or file (:mod:`nebula_rl.flow.prompts`) as entries.
- :func:`dataset_entries`: the entries of a config's dataset (or validation dataset): one of
  the two layouts (from a folder, or from WebDataset shards unpacked into one,
  :mod:`nebula_rl.data.shards`), the toy dataset (written into the run folder first), or a
  prompt set or file (:mod:`nebula_rl.flow.prompts`); :func:`world_rows`: the controller's rows of them, listed
  without reading a clip.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from nebula_rl.config import Config
from nebula_rl.data.shards import is_shards, unpacked
from nebula_rl.flow.prompts import PROMPT_SETS, is_prompt_dataset, read_prompts
from nebula_rl.rewards.shapes import COLOURS, SHAPES, shape_mask

__all__ = [
    "TOY_DATASET",
    "TOY_PROMPTS",
    "VIDEO_FPS",
    "Entries",
    "Entry",
    "caption_layout",
    "dataset_entries",
    "local_layout",
    "make_toy_dataset",
    "prompt_entries",
    "toy_text_embedding",
    "world_rows",
    "write_mp4",
]

TOY_DATASET = "builtin:toy_video"
_EMBED_DIRS = ("t5_xxl", "text_embedding")


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of a world-model dataset: its name, its caption and the files that hold its clip
    (local layout: the video and the text embeddings; diffusers layout: the image or video; a
    prompt: none)."""

    stem: str
    caption: str
    files: tuple[Path, ...] = ()


@dataclass(frozen=True, slots=True)
class Entries:
    """A dataset's entries, in row order, with the layout that holds them and the config key
    that named it (for errors)."""

    layout: Literal["local", "captions", "prompts"]
    entries: list[Entry]
    key: str


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
    shape = next(w for w in caption.split() if w in SHAPES)
    centre = rng.uniform(0.4, 0.6, size=2)
    drift = rng.uniform(-0.03, 0.03, size=2)
    video = np.empty((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        background = rng.uniform(0, 40, size=(size, size, 3))
        cy, cx = centre + t * drift
        mask = shape_mask(shape, size, centre=(float(cy), float(cx)))
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


def local_layout(root: Path | str, *, key: str = "dataset") -> list[Entry]:
    """The entries of a folder in cosmos-rl's local layout, in stem order, each with its video
    and embeddings file (checked to exist, not read); `key` names the config key that gave
    `root` in errors."""
    root = Path(root)
    metas = sorted((root / "metas").glob("*.txt"))
    if not metas:
        raise ValueError(f"{key}: {root} has no metas/*.txt (cosmos-rl's local dataset layout)")
    entries = []
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
        entries.append(Entry(stem, meta.read_text().strip(), (video_path, embed_path)))
    return entries


_VISUALS = (".jpg", ".jpeg", ".png", ".mp4", ".npy")


def caption_layout(root: Path | str, *, key: str) -> list[Entry]:
    """The entries of a folder in cosmos-rl's diffusers layout (`dataset.local_dir`), in stem
    order: `<stem>.json` holds the caption (`"prompt"`), `<stem>.jpg` / `.png` the image or
    `<stem>.mp4` (`.npy`) the video (checked to exist, not read)."""
    root = Path(root)
    metas = sorted(root.glob("*.json"))
    if not metas:
        raise ValueError(
            f"{key}: {root} has no <stem>.json captions (cosmos-rl's diffusers layout)"
        )
    entries = []
    for meta in metas:
        try:
            caption = str(json.loads(meta.read_text())["prompt"]).strip()
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f'{key}: {meta} must be an object with a "prompt" ({err})') from err
        visual = next((p for ext in _VISUALS if (p := meta.with_suffix(ext)).exists()), None)
        if visual is None:
            raise ValueError(f"{key}: {meta.stem!r} has no {' / '.join(_VISUALS)} beside {meta}")
        entries.append(Entry(meta.stem, caption, (visual,)))
    return entries


def prompt_entries(name: str, split: str, *, key: str) -> list[Entry]:
    """The prompts of prompt set or file `name` (:mod:`nebula_rl.flow.prompts`) as entries
    without files, named `prompt_<index>`."""
    return [Entry(f"prompt_{i:06d}", p) for i, p in enumerate(read_prompts(name, split, key=key))]


def dataset_entries(
    cfg: Config, run_dir: Path, *, create: bool = True, validation: bool = False
) -> Entries:
    """The entries of `cfg`'s dataset (with `validation`, of `validation.dataset`, its first
    `validation.max_num_prompts`); a toy dataset is written into the run folder when `create`
    (once per job: the job's other processes read what the first wrote), the validation one
    with another seed than the training one's (other clips of the same captions)."""
    d = cfg.policy.diffusers
    ds = cfg.validation.dataset if validation else cfg.train.train_policy.dataset
    key = "validation.dataset.name" if validation else "train.train_policy.dataset.name"
    limit = cfg.validation.max_num_prompts if validation else None
    if ds.local_dir and not validation:  # (cosmos-rl's diffusers folder: captions, no embeddings)
        key = "train.train_policy.dataset.local_dir"
        return Entries("captions", caption_layout(ds.local_dir, key=key), key)
    name = ds.name or (ds.local_dir if validation else "")
    if is_prompt_dataset(name):  # (captions only: the model's text encoder embeds them)
        key = key if ds.name else "validation.dataset.local_dir"
        prompts = [e for split in ds.split for e in prompt_entries(name, split, key=key)]
        return Entries("prompts", _first(prompts, limit), key)
    if ds.split != ["train"]:
        raise ValueError(
            f"{key.replace('.name', '.split')} = {ds.split}: a clip folder ({ds.name}) has no "
            "splits; splits name the parts of a prompt set"
        )
    if is_shards(ds.name):  # (WebDataset shards, unpacked into a folder of either layout)
        root = unpacked(ds.name, key=key)
        if not (root / "metas").is_dir():
            return Entries("captions", _first(caption_layout(root, key=key), limit), key)
        return Entries("local", _first(local_layout(root, key=key), limit), key)
    if ds.name == TOY_DATASET:
        seed = (cfg.train.seed or 0) + (1 if validation else 0)
        frames = d.inference_frames if d.is_video else 1
        kwargs = {"size": d.inference_size[0], "frames": frames, "seed": seed}
        root = run_dir / ("val_dataset" if validation else "dataset")
        if create:
            make_toy_dataset(root, **{**kwargs, **ds.kwargs})
    elif ds.name and Path(ds.name).is_dir():
        root = Path(ds.name)
    else:
        raise ValueError(
            f"{key}: {ds.name!r}: a world-model run reads a local folder in cosmos-rl's layout "
            f"(metas/, videos/, t5_xxl/), {TOY_DATASET}, a prompt file (.txt, .jsonl, .json) or "
            f"one of cosmos-rl's prompt sets ({', '.join(PROMPT_SETS)})"
        )
    return Entries("local", _first(local_layout(root, key=key), limit), key)


def _first(entries: list[Entry], limit: int | None) -> list[Entry]:
    """The first `limit` entries (`validation.max_num_prompts` of a validation dataset)."""
    return entries[:limit]


def world_rows(cfg: Config, run_dir: Path, *, validation: bool = False) -> list[dict[str, str]]:
    """The controller's rows (with `validation`, its validation rows): one per clip, its caption
    and name, listed without reading a clip (a toy dataset is written into the run folder
    first). Prompts carry only the row's index; replicas read the clips."""
    listed = dataset_entries(cfg, run_dir, create=True, validation=validation)
    return [{"caption": e.caption, "clip": e.stem} for e in listed.entries]
