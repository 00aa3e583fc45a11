"""Vision-language inputs: chat messages whose content items are text, images and videos, turned
into what a Qwen-VL-family model takes, the same way on every side of a job.

A message's `content` is a string or a list of items (the form Qwen-VL's chat template and
cosmos-rl's datasets use)::

    {"type": "text", "text": "How many squares?"}
    {"type": "image", "image": <source>, "max_pixels": 81920}
    {"type": "video", "video": <source or list of frame sources>, "fps": 1}

An image source is a path (or `file://` URL), an `http(s)://` URL, a `data:` URI or a bare base64
string, raw bytes, or a PIL image; a video is a list of such frames (taken as sampled at `fps`),
or a video file, decoded with PyAV when it is installed. Media travel through the job by
reference (these sources) and every side decodes them again, deterministically.

Per-item settings (cosmos-rl's names): `min_pixels` / `max_pixels` (bounds on the pixels of an
image or of each video frame, which is resized to multiples of `patch_size x merge_size`, keeping
its aspect ratio), `resized_height` / `resized_width` (an exact size, rounded the same way),
`fps` (frames per second of a frame list; the rate to sample a video file at), `nframes` /
`min_frames` / `max_frames` (how many frames to keep), `total_pixels` (a budget for all frames of
a video). Frames are kept in multiples of the temporal patch (2; Cosmos 3 Edge's: 1), repeating
the last one.

:class:`VisionProcessor` renders the conversation with the tokenizer's chat template (one
`<|vision_start|><|image_pad|><|vision_end|>` per image), expands each pad to the media's number
of language tokens (`prod(grid_thw) / merge_size**2`; Qwen3-VL writes a video per temporal patch,
after a `<t seconds>` timestamp), and cuts the pixels into patches: images through transformers'
`Qwen2VLImageProcessorPil` (Cosmos 3 Edge's `Cosmos3EdgeImageProcessorPil`), video frames with the same patch layout here (transformers' video
processors need torchvision). :func:`collate` pads a batch, which may mix samples with and without
media, and adds `mm_token_type_ids` (0 text, 1 image, 2 video), which transformers 5's Qwen-VL
forward requires alongside pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import (
    Cosmos3EdgeImageProcessorPil,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2VLImageProcessorPil,
)

from nebula_rl.config import VISION_OPTIONS, PolicyConfig

__all__ = [
    "VISION_OPTIONS",
    "VisionInputs",
    "VisionProcessor",
    "collate",
    "load_image",
    "media_items",
    "media_kwargs",
    "smart_resize",
    "vision_processor",
]


_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "cosmos3_omni", "cosmos3_edge")
"""The families built here; Cosmos 3's reasoner (`cosmos3_omni`) is Qwen3-VL's architecture and
preprocessing under its own name; Cosmos 3 Edge (`cosmos3_edge`) takes Qwen3-VL's prompt layout
(a timestamp before each frame) with one frame per temporal patch and its patch values in
(row, column, channel) order."""
_EDGE = "cosmos3_edge"
ImageProcessor = Qwen2VLImageProcessorPil | Cosmos3EdgeImageProcessorPil
# Preprocessing of the presets (a real model's folder has its own preprocessor_config.json):
# pixel bounds in language tokens of patch x merge pixels squared, and each family's
# normalisation (Qwen2.5-VL keeps CLIP's mean and std, Qwen3-VL uses 0.5).
_PRESET_TOKENS = (4, 256)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DEFAULT_FPS = 2.0
_MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size Qwen-VL models see an image of `height x width` at: both sides multiples of
    `factor` (patch x merge), the area within `[min_pixels, max_pixels]`, the aspect ratio
    kept as closely as rounding allows."""
    if min(height, width) < 1:
        raise ValueError(f"an image of {height}x{width} pixels has nothing to see")
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ValueError(
            f"an image of {height}x{width} pixels is too elongated (aspect ratio over "
            f"{_MAX_ASPECT_RATIO})"
        )
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def load_image(source: object) -> Image.Image:
    """An RGB PIL image from a PIL image, bytes, a `data:` URI, a bare base64 string, an
    `http(s)://` URL, a `file://` URL or a path."""
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, bytes | bytearray):
        image = Image.open(io.BytesIO(source))
    elif isinstance(source, str | Path):
        text = str(source)
        if text.startswith("data:"):
            _, _, payload = text.partition(",")
            image = Image.open(io.BytesIO(base64.b64decode(payload)))
        elif text.startswith(("http://", "https://")):
            import httpx

            response = httpx.get(text, follow_redirects=True, timeout=60)
            response.raise_for_status()
            image = Image.open(io.BytesIO(response.content))
        else:
            path = Path(text.removeprefix("file://"))
            try:
                is_file = path.is_file()
            except OSError:  # (a base64 string is too long a name)
                is_file = False
            if is_file:
                image = Image.open(path)
            else:
                try:
                    data = base64.b64decode(text, validate=True)
                except (binascii.Error, ValueError):
                    raise FileNotFoundError(f"image {text[:80]!r}: no such file") from None
                image = Image.open(io.BytesIO(data))
    else:
        raise TypeError(f"cannot read an image from a {type(source).__name__}")
    return image.convert("RGB")


def _load_frames(source: object, options: dict[str, Any]) -> tuple[list[Image.Image], float]:
    """A video's frames and the rate they were sampled at."""
    fps = float(options.get("fps", _DEFAULT_FPS))
    if isinstance(source, list | tuple):
        frames = [load_image(f) for f in source]
    else:
        frames, fps = _decode_video(str(source), fps)
    if not frames:
        raise ValueError("a video needs at least one frame")
    count = len(frames)
    if "nframes" in options:
        count = int(options["nframes"])
    count = max(
        int(options.get("min_frames", 1)), min(count, int(options.get("max_frames", count)))
    )
    if count != len(frames):  # evenly spaced over the clip
        picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
        fps *= count / len(frames)
        frames = [frames[i] for i in picks]
    return frames, fps


def _decode_video(path: str, fps: float) -> tuple[list[Image.Image], float]:
    """Frames of a video file sampled at about `fps` (PyAV)."""
    try:
        import av
    except ImportError:
        raise ImportError(
            f"video {path!r}: decoding a video file needs PyAV (`pip install av`); "
            "or give the video as a list of frames"
        ) from None
    with av.open(path.removeprefix("file://")) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or fps)
        step = max(1, round(rate / fps))
        frames = [
            frame.to_image() for i, frame in enumerate(container.decode(stream)) if i % step == 0
        ]
    return frames, rate / step


def media_items(messages: Sequence[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """("image" | "video", item) for every media item of `messages`, in order."""
    found = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for item in content:
            kind = item.get("type")
            if kind in ("image", "video") or (
                kind is None and ("image" in item or "video" in item)
            ):
                found.append(("image" if "image" in item or kind == "image" else "video", item))
    return found


@dataclass(slots=True)
class VisionInputs:
    """One sample, ready to batch with :func:`collate`."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None
    """Image patches, (patches, channels x temporal patch x patch x patch)."""
    image_grid_thw: torch.Tensor | None = None
    """(images, 3): each image's grid of patches (time, height, width)."""
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: list[float] = field(default_factory=list)
    """Qwen2.5-VL: seconds per temporal patch of each video (M-RoPE's time axis)."""

    @property
    def has_media(self) -> bool:
        """Whether the sample holds an image or a video."""
        return self.pixel_values is not None or self.pixel_values_videos is not None


@dataclass(frozen=True, slots=True)
class _Layout:
    model_type: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_token_id: int
    video_token_id: int

    @property
    def channels_last(self) -> bool:
        """Whether a patch's values run (row, column, channel, frame), Cosmos 3 Edge's order;
        else (channel, frame, row, column), Qwen-VL's."""
        return self.model_type == _EDGE

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


class VisionProcessor:
    """Conversations -> model inputs for a Qwen2.5-VL, Qwen3-VL or Cosmos 3 reasoner (Nano,
    Super, Edge) model.

    Args:
        tokenizer: the model's tokenizer, with its chat template and the vision tokens.
        config: the model's config (patch sizes and vision token ids are read from it).
        image_processor: transformers' `Qwen2VLImageProcessorPil` (Cosmos 3 Edge:
            `Cosmos3EdgeImageProcessorPil`) with the model's normalisation and default pixel
            bounds (default: the preset's).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        config: PretrainedConfig,
        image_processor: ImageProcessor | None = None,
    ) -> None:
        model_type = str(config.model_type)
        if model_type not in _MODEL_TYPES:
            raise ValueError(
                f"vision inputs are built for {list(_MODEL_TYPES)} models, not {model_type!r}"
            )
        vision = config.vision_config
        self.layout = _Layout(
            model_type,
            int(vision.patch_size),
            int(vision.spatial_merge_size),
            int(getattr(vision, "temporal_patch_size", 1)),  # (Edge: one frame per patch)
            int(config.image_token_id),
            int(config.video_token_id),
        )
        self.tokenizer = tokenizer
        self.image_processor = image_processor or self.preset_image_processor(config)
        size = self.image_processor.size  # (a SizeDict)
        self.min_pixels = int(getattr(size, "shortest_edge", 0) or 0)
        self.max_pixels = int(getattr(size, "longest_edge", 0) or 0)

        def token(token_id: int) -> str:
            text = tokenizer.convert_ids_to_tokens(int(token_id))
            assert isinstance(text, str)
            return text

        self._pad = {
            "image": token(self.layout.image_token_id),
            "video": token(self.layout.video_token_id),
        }
        self._start_id = int(config.vision_start_token_id)
        self._end_id = int(config.vision_end_token_id)
        self._start = token(self._start_id)
        self._end = token(self._end_id)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, revision: str | None = None) -> VisionProcessor:
        """The processor of a model folder, Hub repo id or preset: its tokenizer and config,
        and the image processor its `preprocessor_config.json` describes (a preset's
        otherwise)."""
        from nebula_rl.models import PRESET_PREFIX, load_model_config, load_tokenizer, resolve_model

        tokenizer = load_tokenizer(name_or_path, revision=revision)
        config = load_model_config(name_or_path, revision=revision)
        image_processor = None
        if not name_or_path.startswith(PRESET_PREFIX):
            path = resolve_model(name_or_path, revision=revision)
            if (path / "preprocessor_config.json").is_file():
                kind = (
                    Cosmos3EdgeImageProcessorPil
                    if str(config.model_type) == _EDGE
                    else Qwen2VLImageProcessorPil
                )
                image_processor = kind.from_pretrained(path, local_files_only=True)
        return cls(tokenizer, config, image_processor)

    def save_pretrained(self, path: str | Path) -> None:
        """Write the tokenizer and the image processor's `preprocessor_config.json` into `path`
        (next to a model's export: what `from_pretrained` reads back)."""
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    @staticmethod
    def preset_image_processor(config: PretrainedConfig) -> ImageProcessor:
        """The image processor of a preset: `config`'s patch sizes, the family's normalisation,
        pixel bounds of 4 to 256 language tokens."""
        vision = config.vision_config
        factor = int(vision.patch_size) * int(vision.spatial_merge_size)
        size = {
            "shortest_edge": _PRESET_TOKENS[0] * factor**2,
            "longest_edge": _PRESET_TOKENS[1] * factor**2,
        }
        if str(config.model_type) == _EDGE:  # (its mean and std are 0.5, as Qwen3-VL's)
            settings: dict[str, Any] = dict(  # (keyword arguments its stub does not list)
                patch_size=int(vision.patch_size),
                merge_size=int(vision.spatial_merge_size),
                size=size,
            )
            return Cosmos3EdgeImageProcessorPil(**settings)
        qwen3 = str(config.model_type) != "qwen2_5_vl"  # (Qwen3-VL's, Cosmos 3's)
        return Qwen2VLImageProcessorPil(
            patch_size=int(vision.patch_size),
            merge_size=int(vision.spatial_merge_size),
            temporal_patch_size=int(vision.temporal_patch_size),
            size=size,
            image_mean=(0.5, 0.5, 0.5) if qwen3 else _CLIP_MEAN,
            image_std=(0.5, 0.5, 0.5) if qwen3 else _CLIP_STD,
        )

    # -- one sample ---------------------------------------------------------------------------

    def __call__(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = False,
        completion_ids: Sequence[int] = (),
    ) -> VisionInputs:
        """`messages` rendered with the chat template, tokenized and expanded, its media cut into
        patches; `completion_ids` (generated tokens) appended after the prompt."""
        out: Any = self.tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True,
            add_generation_prompt=add_generation_prompt,
        )  # fmt: skip
        ids = [int(t) for t in out["input_ids"]]
        inputs, _ = self.expand(ids, [0] * len(ids), messages)
        inputs.input_ids += list(completion_ids)
        return inputs

    def prompt(
        self, prompt: str | Sequence[dict[str, Any]], *, system_prompt: str = ""
    ) -> VisionInputs:
        """A prompt (a user turn's text, or chat messages) ready for generation: chat template
        with the assistant header, media expanded and cut into patches. The rollout generates
        from these ids and pixels; the policy builds them again from the same prompt to
        recompute log-probs, so both see the same tokens."""
        from nebula_rl.data import prompt_messages

        return self(prompt_messages(prompt, system_prompt), add_generation_prompt=True)

    def sft_example(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        system_prompt: str = "",
        max_length: int | None = None,
    ) -> tuple[VisionInputs, list[int]]:
        """A conversation for SFT: its inputs and a loss mask that is 1 on the assistant's
        tokens only (never on a media token). Refuses a conversation longer than `max_length`
        rather than cutting it inside an image."""
        from nebula_rl.data import sft_example

        ids, mask = sft_example(self.tokenizer, list(messages), system_prompt=system_prompt)
        inputs, mask = self.expand(ids, mask, messages)
        if max_length is not None and len(inputs.input_ids) > max_length:
            raise ValueError(
                f"a conversation of {len(inputs.input_ids)} tokens with its media is longer than "
                f"policy.model_max_length = {max_length}"
            )
        return inputs, mask

    def expand(
        self, ids: Sequence[int], mask: Sequence[int], messages: Sequence[dict[str, Any]]
    ) -> tuple[VisionInputs, list[int]]:
        """Token ids in which the chat template wrote one `start, pad, end` per media item of
        `messages` -> the inputs with each pad expanded to its media's tokens and patches cut,
        and `mask` (one value per id) stretched alike: expanded tokens are never trained."""
        items = media_items(messages)
        pads = {self.layout.image_token_id, self.layout.video_token_id}
        at = [i for i, t in enumerate(ids) if t in pads]
        if len(at) != len(items):
            raise ValueError(
                f"the chat template wrote {len(at)} media markers for {len(items)} images and "
                "videos"
            )
        inputs = VisionInputs(input_ids=[])
        images: list[torch.Tensor] = []
        image_grids: list[torch.Tensor] = []
        videos: list[torch.Tensor] = []
        video_grids: list[torch.Tensor] = []
        out_ids: list[int] = []
        out_mask: list[int] = []
        done = 0
        for position, (kind, item) in zip(at, items, strict=True):
            want = self.layout.image_token_id if kind == "image" else self.layout.video_token_id
            bounded = 0 < position < len(ids) - 1 and (ids[position - 1], ids[position + 1]) == (
                self._start_id,
                self._end_id,
            )
            if ids[position] != want or not bounded:
                raise ValueError(
                    f"media item {len(images) + len(videos)} ({kind}): the chat template must "
                    "write <|vision_start|>, its pad token and <|vision_end|> in its place"
                )
            options = {k: v for k, v in item.items() if k in VISION_OPTIONS}
            if kind == "image":
                patches, grid = self._image(item["image"], options)
                images.append(patches)
                image_grids.append(grid)
                text = self._wrap(self._pad["image"] * self._tokens(grid))
            else:
                patches, grid, fps = self._video(item["video"], options)
                videos.append(patches)
                video_grids.append(grid)
                inputs.second_per_grid_ts.append(self.layout.temporal_patch_size / fps)
                text = self._video_text(grid, fps)
            # The marker is start, pad, end: replace all three.
            expansion = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out_ids += [*ids[done : position - 1], *expansion]
            out_mask += [*mask[done : position - 1], *([0] * len(expansion))]
            done = position + 2
        out_ids += ids[done:]
        out_mask += mask[done:]
        inputs.input_ids = [int(t) for t in out_ids]
        if images:
            inputs.pixel_values = torch.cat(images)
            inputs.image_grid_thw = torch.stack(image_grids)
        if videos:
            inputs.pixel_values_videos = torch.cat(videos)
            inputs.video_grid_thw = torch.stack(video_grids)
        return inputs, [int(m) for m in out_mask]

    def _wrap(self, pads: str) -> str:
        return self._start + pads + self._end

    def _tokens(self, grid: torch.Tensor) -> int:
        return int(grid.prod()) // self.layout.merge_size**2

    def _bounds(self, options: dict[str, Any]) -> tuple[int, int]:
        return (
            int(options.get("min_pixels", self.min_pixels)),
            int(options.get("max_pixels", self.max_pixels)),
        )

    def _size(
        self, image: Image.Image, options: dict[str, Any], low: int, high: int
    ) -> tuple[int, int]:
        """(height, width) the model sees `image` at: `resized_height` / `resized_width` when
        given, else its own, rounded and bounded by `smart_resize`."""
        return smart_resize(
            int(options.get("resized_height", image.height)),
            int(options.get("resized_width", image.width)),
            factor=self.layout.factor,
            min_pixels=low,
            max_pixels=high,
        )

    def _image(self, source: object, options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        image = load_image(source)
        low, high = self._bounds(options)
        if "resized_height" in options or "resized_width" in options:
            height, width = self._size(image, options, low, high)
            image = image.resize((width, height), Image.Resampling.BICUBIC)
            out = self.image_processor(images=[image], do_resize=False, return_tensors="pt")
        else:
            size = {"shortest_edge": low, "longest_edge": high}
            out = self.image_processor(images=[image], size=size, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"][0]

    def _video(
        self, source: object, options: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        frames, fps = _load_frames(source, options)
        tp = self.layout.temporal_patch_size
        while len(frames) % tp:
            frames.append(frames[-1])
        low, high = self._bounds(options)
        if "total_pixels" in options:  # a budget for every frame together
            per_frame = int(options["total_pixels"]) * tp // len(frames)
            high = max(min(high, per_frame), low)
        height, width = self._size(frames[0], options, low, high)
        pixels = np.stack(
            [
                np.asarray(f.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
                for f in frames
            ]
        )
        mean = np.asarray(self.image_processor.image_mean, dtype=np.float32)
        std = np.asarray(self.image_processor.image_std, dtype=np.float32)
        pixels = (pixels * float(self.image_processor.rescale_factor) - mean) / std
        return (*self._patchify(torch.from_numpy(pixels).permute(0, 3, 1, 2)), fps)

    def _patchify(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, C, H, W) -> patches in the order the vision tower reads them (each merge window's
        patches together, row by row), and the (t, h, w) grid."""
        p, m, tp = self.layout.patch_size, self.layout.merge_size, self.layout.temporal_patch_size
        t, c, h, w = frames.shape
        grid = (t // tp, h // p, w // p)
        x = frames.reshape(grid[0], tp, c, grid[1] // m, m, p, grid[2] // m, m, p)
        if self.layout.channels_last:  # (Edge: row, column, channel, frame)
            x = x.permute(0, 3, 6, 4, 7, 5, 8, 2, 1)
        else:  # (Qwen-VL: channel, frame, row, column)
            x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(grid[0] * grid[1] * grid[2], c * tp * p * p), torch.tensor(grid)

    def _video_text(self, grid: torch.Tensor, fps: float) -> str:
        pads = self._pad["video"] * (int(grid[1] * grid[2]) // self.layout.merge_size**2)
        if self.layout.model_type == "qwen2_5_vl":
            return self._wrap(pads * int(grid[0]))
        # Qwen3-VL, Cosmos 3: each temporal patch after the mean time of its frames.
        tp = self.layout.temporal_patch_size
        text = ""
        for t in range(int(grid[0])):
            seconds = (t * tp + (t * tp + tp - 1)) / 2 / fps
            text += f"<{seconds:.1f} seconds>" + self._wrap(pads)
        return text


def vision_processor(policy: PolicyConfig, config: PretrainedConfig) -> VisionProcessor | None:
    """The processor of the job's model (`policy.model_name_or_path`) when `config`, its config,
    is a vision-language model's; None for a language model."""
    if getattr(config, "vision_config", None) is None:
        return None
    return VisionProcessor.from_pretrained(
        policy.model_name_or_path, revision=policy.model_revision
    )


def media_kwargs(
    samples: Sequence[VisionInputs | None],
    input_ids: torch.Tensor,
    *,
    image_token_id: int,
    video_token_id: int,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The keyword arguments a Qwen-VL forward takes besides the tokens, for the rows
    `input_ids` of `samples` (None: a row without media): `mm_token_type_ids` (0 text, 1 image,
    2 video; 0 on padding), and the pixels and grids of the rows that have media, concatenated
    in row order."""
    real = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    kwargs = {
        "mm_token_type_ids": ((input_ids == image_token_id).long()
                              + 2 * (input_ids == video_token_id).long()) * real,
    }  # fmt: skip
    present = [s for s in samples if s is not None]
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [getattr(s, key) for s in present if getattr(s, key) is not None]
        if parts:
            kwargs[key] = torch.cat(parts)
    seconds = [t for s in present for t in s.second_per_grid_ts]
    if seconds:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    return kwargs


def collate(
    samples: Sequence[VisionInputs],
    *,
    pad_token_id: int,
    image_token_id: int,
    video_token_id: int,
    padding_side: str = "right",
) -> dict[str, torch.Tensor]:
    """Pad a batch (samples with and without media alike) into the keyword arguments of a
    Qwen-VL forward: `input_ids`, `attention_mask`, `mm_token_type_ids`, and the pixels and
    grids of the samples that have media, concatenated in batch order."""
    longest = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        cols = slice(longest - n, longest) if padding_side == "left" else slice(0, n)
        ids[row, cols] = torch.tensor(sample.input_ids, dtype=torch.long)
        mask[row, cols] = 1
    media = media_kwargs(
        samples, ids, image_token_id=image_token_id, video_token_id=video_token_id,
        attention_mask=mask,
    )  # fmt: skip
    return {"input_ids": ids, "attention_mask": mask, **media}
