"""The reward service's requests: its paths (cosmos-rl's protocol), an enqueue body
(`<JSON>\\n<npy bytes>`, or text in the JSON) parsed and checked into samples, and the errors
that answer 4xx."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nebula_rl.rewards.visual import pixels_from_samples

ENQUEUE_PATH = "/api/reward/enqueue"
"""Where a trainer sends a batch to score (cosmos-rl's path)."""
PULL_PATH = "/api/reward/pull"
"""Where a trainer pulls one reward's scores of a batch (cosmos-rl's path)."""
PING_PATH = "/api/reward/ping"
"""Liveness and load, with the token (cosmos-rl's path)."""
HEALTH_PATH = "/health"
"""Liveness probe without the token."""
MEDIA_TYPES = ("latent", "video", "image", "text")
"""What the array of an enqueue request holds (its JSON `media_type`)."""
MAX_FORM_BYTES = 64 << 10
"""Largest pull or ping body (a few form fields)."""


# Requests


class RequestError(Exception):
    """A request the service answers with a 4xx (or 503) and a message, never a 5xx bug."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


@dataclass(frozen=True, slots=True)
class TextSamples:
    """A language model's completions to score, each with its prompt's reference answer."""

    completions: list[str]
    """The generated texts."""
    references: list[str]
    """The dataset's answer of each completion's prompt (what rule rewards compare with)."""

    def __len__(self) -> int:
        return len(self.completions)


Samples = np.ndarray | TextSamples
"""What a task scores: uint8 pixels [B, 3, T, H, W], or text."""


@dataclass
class EnqueueRequest:
    """A parsed enqueue body: samples to score, for which prompts, by which rewards."""

    prompts: list[str]
    """One prompt per sample."""
    rewards: list[str]
    """Reward names with a weight > 0, in request order."""
    pixels: Samples
    """uint8 [B, 3, T, H, W], or the text of `media_type = "text"`."""
    input_info: dict[str, Any]
    """What was received (shape, dtype, min, max, video_infos), echoed by every pull."""


def bad_request(message: str) -> RequestError:
    return RequestError(422, message)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _read_npy(data: bytes) -> np.ndarray:
    """The array of `numpy.save` bytes, its header checked against the bytes present first (a
    header may claim any size)."""
    fp = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
        if dtype.hasobject:
            raise RequestError(400, "the .npy array holds Python objects; send numbers")
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if need != len(data) - fp.tell() or any(d < 0 for d in shape):
            raise RequestError(
                400,
                f"the .npy header describes {need} bytes of data ({dtype} {list(shape)}) but "
                f"{len(data) - fp.tell()} follow it",
            )
        fp.seek(0)
        return np.lib.format.read_array(fp, allow_pickle=False)
    except RequestError:
        raise
    except Exception as err:  # numpy raises ValueError, EOFError, SyntaxError, ... on bad bytes
        raise RequestError(
            400, f"the bytes after the first newline are not an .npy array (numpy.save): {err}"
        ) from None


def parse_enqueue(
    body: bytes, known: Sequence[str], text_rewards: Sequence[str] = ()
) -> EnqueueRequest:
    """Parse and check an enqueue body `<UTF-8 JSON>\\n<npy bytes>` (text: `<UTF-8 JSON>\\n`)
    against the rewards `known`, of which `text_rewards` score text; raises
    :class:`RequestError` (400: unreadable, 422: readable but wrong) naming the problem."""
    sep = body.find(b"\n")
    if sep < 0:
        raise RequestError(400, "the body must be `<JSON>\\n<npy bytes>`: no newline found")
    try:
        header = json.loads(body[:sep].decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:  # (UnicodeDecodeError, JSONDecodeError)
        raise RequestError(400, f"the JSON before the first newline is invalid: {err}") from None
    if not isinstance(header, dict):
        raise RequestError(400, "the JSON before the first newline must be an object")
    text = header.get("media_type") == "text"
    if text and body[sep + 1 :].strip():
        raise RequestError(400, 'media_type "text" sends its samples in the JSON: nothing follows')
    array = None if text else _read_npy(body[sep + 1 :])

    prompts = header.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise bad_request("`prompts` must be a list of strings")
    weights = header.get("reward_fn")
    if not isinstance(weights, dict) or not all(
        isinstance(w, int | float) and not isinstance(w, bool) for w in weights.values()
    ):
        raise bad_request("`reward_fn` must be an object of reward name to weight")
    # cosmos-rl's rule: a weight <= 0 turns that reward off for this request.
    rewards = [name for name, weight in weights.items() if weight > 0]
    unknown = [name for name in rewards if name not in known]
    if unknown:
        raise bad_request(
            f"`reward_fn` names unknown reward(s) {', '.join(map(repr, unknown))}: this service "
            f"runs {', '.join(known)}"
        )
    if not rewards:
        raise bad_request("`reward_fn` names no reward with a weight > 0")
    media_type = header.get("media_type", "latent")
    if not isinstance(media_type, str) or media_type.lower() not in MEDIA_TYPES:
        raise bad_request(f"unknown `media_type` {media_type!r}: one of {', '.join(MEDIA_TYPES)}")
    wrong = [name for name in rewards if (name in text_rewards) != text]
    if wrong:
        kind = "text" if text else "images and videos"
        raise bad_request(
            f"`reward_fn` asks {', '.join(map(repr, wrong))} for {kind}: "
            + ('text rewards take media_type "text"' if not text else "they score pixels")
        )
    if text:
        return _parse_text(header, prompts, rewards)
    assert array is not None
    video_infos = header.get("video_infos", [])
    if not isinstance(video_infos, list) or not all(isinstance(v, dict) for v in video_infos):
        raise bad_request('`video_infos` must be a list of objects (e.g. {"video_fps": 16.0})')
    try:  # echoed by every pull: it must go back out as JSON
        json.dumps(video_infos, allow_nan=False)
    except ValueError:
        raise bad_request("`video_infos` holds a number JSON cannot carry (too large)") from None

    tensor, pixels = _pixels(_tensor(array), media_type.lower())
    if pixels.shape[0] != len(prompts):
        raise bad_request(f"{pixels.shape[0]} samples but {len(prompts)} prompts")
    input_info = {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype),
        "min": float(tensor.min()),
        "max": float(tensor.max()),
        "video_infos": video_infos,
    }
    return EnqueueRequest(prompts, rewards, pixels.numpy(), input_info)


def _parse_text(header: dict[str, Any], prompts: list[str], rewards: list[str]) -> EnqueueRequest:
    """The text samples of a `media_type = "text"` request: `completions` and `references`,
    one string each per prompt."""
    fields = {}
    for key in ("completions", "references"):
        value = header.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad_request(f'`{key}` must be a list of strings (media_type "text")')
        if len(value) != len(prompts):
            raise bad_request(f"{len(value)} {key} but {len(prompts)} prompts")
        fields[key] = value
    if not prompts:
        raise bad_request("no completions to score")
    input_info = {"media_type": "text", "count": len(prompts)}
    return EnqueueRequest(prompts, rewards, TextSamples(**fields), input_info)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A received array as a tensor: uint8 kept, other integers as int64, floats as they are."""
    if array.dtype.kind not in "uif" or array.dtype.itemsize > 8:
        raise bad_request(f"the array's dtype {array.dtype} is not supported: send uint8 or floats")
    if array.size == 0:
        raise bad_request(f"the array is empty (shape {list(array.shape)})")
    if array.dtype.kind in "ui" and array.dtype != np.uint8:
        array = array.astype(np.int64)  # torch has no uint16/32/64 arithmetic
    # (torch takes native byte order only)
    return torch.from_numpy(np.ascontiguousarray(array.astype(array.dtype.newbyteorder("="))))


def _pixels(tensor: torch.Tensor, media_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the array as received, its uint8 pixels [B, 3, T, H, W]) for `media_type`."""
    if media_type == "latent":
        if tensor.dtype == torch.uint8:
            # cosmos-rl sends bfloat16 samples as their bytes, which numpy has no type for.
            if tensor.dim() == 0 or tensor.shape[-1] % 2:
                raise bad_request(
                    "a uint8 latent array holds bfloat16 bytes: its last axis must be even"
                )
            tensor = tensor.view(torch.bfloat16)
        elif not tensor.is_floating_point():
            raise bad_request(
                f"latent samples must be floats in [-1, 1] (or bfloat16 bytes as uint8), got "
                f"{tensor.dtype}"
            )
        _layout(tensor, 5, 1, "latent samples [B, C=3, T, H, W]")
        if not bool(torch.isfinite(tensor).all()):
            raise bad_request("the latent samples hold NaN or infinite values")
        return tensor, pixels_from_samples(tensor)
    if media_type == "video":
        _layout(tensor, 5, 1, "video [B, C=3, T, H, W] of values 0..255")
        return tensor, _bytes(tensor, "video")
    _layout(tensor, 4, 3, "images [B, H, W, C=3] of values 0..255")
    return tensor, _bytes(tensor, "image").permute(0, 3, 1, 2).unsqueeze(2).contiguous()


def _layout(tensor: torch.Tensor, dims: int, channel_axis: int, what: str) -> None:
    if tensor.dim() != dims or tensor.shape[channel_axis] != 3:
        raise bad_request(f"expected {what}, got shape {list(tensor.shape)}")


def _bytes(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Values 0..255 as uint8 (rounded); anything else is refused, not wrapped around."""
    if tensor.dtype == torch.uint8:
        return tensor
    values = tensor.double()
    if not bool(torch.isfinite(values).all()) or values.min() < 0 or values.max() > 255:
        raise bad_request(f"{what} values must lie in 0..255")
    return values.round().to(torch.uint8)
