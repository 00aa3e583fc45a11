"""The reward service (`nebula-rl reward-service`): scores generated images and videos (world
models) or completions' text (language models) over HTTP for a trainer, in cosmos-rl's
reward-service protocol, with the rewards of :mod:`nebula_rl.rewards.visual`, the registered text
rewards of :mod:`nebula_rl.rewards` (`gsm8k`, `arithmetic`, ...), or any `module.path:function`
of either signature.

A trainer enqueues a batch (`POST /api/reward/enqueue`, body `<JSON>\\n<npy bytes>`; for text,
`media_type = "text"` with the completions and references in the JSON and nothing after the
newline) and gets a uuid at once; worker processes score it; the trainer pulls each reward's
scores by uuid and name (`POST /api/reward/pull`, form fields `uuid` and `type`; 400 until they
are ready). Every endpoint but `/health` needs `Authorization: Bearer <token>`.

Inside: a bounded queue (`max_pending` tasks waiting or running; 429 beyond it, never a silent
drop), one shared pool of `num_workers` spawned processes that run any of the configured rewards,
batching of queued requests of the same reward and sample shape (text: of the same reward) into
one call, and a supervisor thread that puts the tasks of a worker that died back at the front of
the queue and starts a new worker. Results stay in this process's memory for `result_ttl_s`.
See docs/reward-service.md.
"""

from __future__ import annotations

import importlib
import io
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import secrets
import signal
import socket
import threading
import time
import tomllib
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import parse_qs

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError, ValidationInfo, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from nebula_rl.config import ConfigError, _Section
from nebula_rl.http_server import HttpServer, bearer_matches, serve
from nebula_rl.rewards.base import REWARDS, RewardFn, get_reward
from nebula_rl.rewards.visual import VISUAL_REWARDS, VisualReward, pixels_from_samples

__all__ = [
    "ENQUEUE_PATH",
    "MEDIA_TYPES",
    "PING_PATH",
    "PULL_PATH",
    "TOKEN_ENV",
    "EnqueueRequest",
    "RequestError",
    "RewardArgs",
    "RewardService",
    "RewardServiceConfig",
    "RunningService",
    "TextSamples",
    "bind_socket",
    "create_app",
    "load_service_config",
    "parse_enqueue",
    "resolve_reward",
    "resolve_token",
    "run_service",
    "service_config_from_dict",
    "start_service",
]

log = logging.getLogger(__name__)

ENQUEUE_PATH = "/api/reward/enqueue"
"""Where a trainer sends a batch to score (cosmos-rl's path)."""
PULL_PATH = "/api/reward/pull"
"""Where a trainer pulls one reward's scores of a batch (cosmos-rl's path)."""
PING_PATH = "/api/reward/ping"
"""Liveness and load, with the token (cosmos-rl's path)."""
HEALTH_PATH = "/health"
"""Liveness probe without the token."""
TOKEN_ENV = "NEBULA_REWARD_TOKEN"
"""Environment variable the service reads its bearer token from (over the config's `token`)."""
MEDIA_TYPES = ("latent", "video", "image", "text")
"""What the array of an enqueue request holds (its JSON `media_type`)."""
MAX_FORM_BYTES = 64 << 10
"""Largest pull or ping body (a few form fields)."""
MAX_START_FAILURES = 3
"""A worker slot that dies this many times in a row before it is ready is given up."""


# --------------------------------------------------------------------------------------------
# Configuration


def resolve_reward(spec: str, *, text: bool = False) -> VisualReward | RewardFn:
    """The reward function `spec` names: a key of `VISUAL_REWARDS`, a registered text reward
    (`nebula_rl.rewards.REWARDS`), or a `module.path:function` (of a text reward with `text`)."""
    if spec in VISUAL_REWARDS:
        return VISUAL_REWARDS[spec]
    if spec in REWARDS or (text and ":" in spec):
        return get_reward(spec)
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: one of {', '.join(sorted(VISUAL_REWARDS))} (images and "
            f"videos), {', '.join(sorted(REWARDS))} (text), or a 'module.path:function' import "
            "path"
        )
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import reward {spec!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not a function")
    return fn  # type: ignore[no-any-return]


def is_text_reward(spec: str, *, text: bool = False) -> bool:
    """Whether the reward `spec` scores text (a registered text reward, or an import path
    declared `text`) rather than pixels."""
    return spec in REWARDS or (text and spec not in VISUAL_REWARDS)


# What each cosmos-rl key of a `[[reward_args]]` entry would ask for, and the values that ask for
# nothing here (empty, or cosmos-rl's own default where that means "the service's environment").
_MODEL = "model-based rewards are not supported yet: the built-in rewards load no model"
_REFUSED_ARGS: dict[str, tuple[str, frozenset[str]]] = {
    "venv_python": (
        "per-reward virtualenvs are not supported yet: every reward runs in the service's own "
        "Python",
        frozenset({"", "python"}),
    ),
    "model_path": (_MODEL, frozenset({""})),
    "download_path": (_MODEL, frozenset({""})),
    "dtype": (_MODEL, frozenset({""})),
    "device": (_MODEL + " (they run on the CPU)", frozenset({"", "cpu"})),
    "endpoint_url": (
        "rewards served by an external endpoint are not supported yet",
        frozenset({""}),
    ),
    "endpoint_api_key": (
        "rewards served by an external endpoint are not supported yet",
        frozenset({""}),
    ),
    "setup_script": ("per-reward setup scripts are not supported yet", frozenset({""})),
    "work_dir": (_MODEL + " (no reward writes files)", frozenset({""})),
    "tmp_dir": (_MODEL + " (no reward writes files)", frozenset({""})),
}
_REDIS = "results are kept in the service's memory; a Redis store is not supported yet"


class RewardArgs(_Section):
    """One reward the service runs (cosmos-rl's `[[reward_args]]` entry)."""

    reward_type: str
    """The reward's name: a key of `nebula_rl.rewards.visual.VISUAL_REWARDS` (images and
    videos), a registered text reward of `nebula_rl.rewards` (`gsm8k`, `arithmetic`, ...: a
    language model's completions), or a `module.path:function` import path (nebula-rl) of a
    function of either signature that the worker processes can import. Requests name the reward
    by this string."""
    text: bool = False
    """nebula-rl: `reward_type` is an import path of a text reward `fn(completion, reference) ->
    float` (registered text rewards are known by name)."""
    enable: bool = True
    """Whether the service runs this reward."""
    venv_python: str = ""
    """cosmos-rl: the interpreter of the reward's own virtualenv; empty or "python" only."""
    model_path: str = ""
    """cosmos-rl: the reward model; empty only."""
    download_path: str = ""
    """cosmos-rl: where to download the reward model; empty only."""
    dtype: str = ""
    """cosmos-rl: the reward model's dtype; empty only."""
    device: str = ""
    """cosmos-rl: the reward model's device; empty or "cpu" only."""
    endpoint_url: str = ""
    """cosmos-rl: an external endpoint serving the reward; empty only."""
    endpoint_api_key: str = ""
    """cosmos-rl: that endpoint's key; empty only."""
    setup_script: str = ""
    """cosmos-rl: a script preparing the reward's environment; empty only."""
    work_dir: str = ""
    """cosmos-rl: the reward's working folder; empty only."""
    tmp_dir: str = ""
    """cosmos-rl: the reward's temporary folder; empty only."""

    @field_validator("reward_type")
    @classmethod
    def _known_reward(cls, value: str) -> str:
        resolve_reward(value)  # imports a `module:function` now, so a typo fails at load
        return value

    @field_validator("text")
    @classmethod
    def _text_path(cls, value: bool, info: ValidationInfo) -> bool:
        name = info.data.get("reward_type", "")
        if value and ":" not in name:
            raise ValueError(f"{name} is known by name: `text` is for import paths")
        return value

    @field_validator(*_REFUSED_ARGS)
    @classmethod
    def _not_supported(cls, value: str, info: ValidationInfo) -> str:
        reason, accepted = _REFUSED_ARGS[str(info.field_name)]
        if value not in accepted:
            raise ValueError(f"{value!r}: {reason}")
        return value


class RewardServiceConfig(_Section):
    """The reward service's settings (cosmos-rl's reward-service TOML, plus nebula-rl's keys)."""

    host: str = "127.0.0.1"
    """Interface to listen on; every interface ("0.0.0.0") only when set so."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Port to listen on (0: any free one); a port in use is an error, never another port."""
    redis_host: str = "localhost"
    """cosmos-rl: its result store's host; accepted at its default only."""
    redis_port: int = 6379
    """cosmos-rl: its result store's port; accepted at its default only."""
    reward_args: list[RewardArgs] = Field(default_factory=list)
    """The rewards the service runs (`[[reward_args]]`); at least one enabled."""
    token: str = ""
    """nebula-rl: the bearer token clients must send ($NEBULA_REWARD_TOKEN wins; neither set:
    one is generated and written to `token_file`)."""
    token_file: str = "reward_service.token"
    """nebula-rl: where a generated token is written (mode 0600), relative to the working
    folder."""
    max_pending: int = Field(default=64, ge=1)
    """nebula-rl: most tasks (enqueued batches) waiting or being scored; more get 429."""
    max_batch_samples: int = Field(default=64, ge=1)
    """nebula-rl: most samples one reward call scores, gathered from several queued tasks of
    the same reward and sample shape (a larger task is scored alone, whole)."""
    num_workers: int = Field(default=1, ge=1)
    """nebula-rl: scoring processes, one shared pool that runs every configured reward."""
    max_attempts: int = Field(default=3, ge=1)
    """nebula-rl: times a task is given to a worker when workers die scoring it; then it fails
    (pull answers 422)."""
    result_ttl_s: float = Field(default=600.0, gt=0)
    """nebula-rl: seconds a finished task's scores are kept for pulls."""
    max_body_mb: float = Field(default=1024.0, gt=0)
    """nebula-rl: largest enqueue body in MiB (413 beyond)."""

    @field_validator("redis_host")
    @classmethod
    def _no_redis_host(cls, value: str) -> str:
        if value != "localhost":
            raise ValueError(f"{value!r}: {_REDIS}")
        return value

    @field_validator("redis_port")
    @classmethod
    def _no_redis_port(cls, value: int) -> int:
        if value != 6379:
            raise ValueError(f"{value}: {_REDIS}")
        return value

    @field_validator("reward_args")
    @classmethod
    def _some_reward(cls, value: list[RewardArgs]) -> list[RewardArgs]:
        names = [a.reward_type for a in value if a.enable]
        if not names:
            raise ValueError("enable at least one reward ([[reward_args]] with a reward_type)")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"names {', '.join(twice)} more than once")
        return value

    @property
    def rewards(self) -> list[str]:
        """The enabled rewards' names, in config order."""
        return [a.reward_type for a in self.reward_args if a.enable]

    @property
    def text_rewards(self) -> list[str]:
        """The enabled rewards that score text."""
        return [
            a.reward_type
            for a in self.reward_args
            if a.enable and is_text_reward(a.reward_type, text=a.text)
        ]


def _key(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the key a user wrote: `reward_args[1].reward_type`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def service_config_from_dict(
    data: dict[str, Any], *, source: str = "<dict>"
) -> RewardServiceConfig:
    """Validate parsed settings; errors raise :class:`~nebula_rl.config.ConfigError` (a
    `ValueError`) naming `source` and each key."""
    try:
        return RewardServiceConfig.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
            where = f"{source}: {_key(e['loc'])}" if e["loc"] else source
            lines.append(f"{where}: {msg.removeprefix('Value error, ')}")
        raise ConfigError("\n".join(lines)) from None


def load_service_config(path: str | Path) -> RewardServiceConfig:
    """Read and validate a reward-service TOML file (e.g. `configs/rewards.toml`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return service_config_from_dict(data, source=str(path))


def resolve_token(cfg: RewardServiceConfig) -> str:
    """The bearer token: $NEBULA_REWARD_TOKEN, else the config's `token`, else a new one written
    to `token_file` (mode 0600; its place is logged, never the token)."""
    token = os.environ.get(TOKEN_ENV, "") or cfg.token
    if token:
        return token
    from nebula_rl.runs import write_private

    token = secrets.token_urlsafe(32)
    path = Path(cfg.token_file).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, token + "\n")
    log.info(
        "no token configured (token, $%s): generated one in %s; give it to trainers as "
        "REMOTE_REWARD_TOKEN",
        TOKEN_ENV,
        path,
    )
    return token


# --------------------------------------------------------------------------------------------
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


def _bad(message: str) -> RequestError:
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
        raise _bad("`prompts` must be a list of strings")
    weights = header.get("reward_fn")
    if not isinstance(weights, dict) or not all(
        isinstance(w, int | float) and not isinstance(w, bool) for w in weights.values()
    ):
        raise _bad("`reward_fn` must be an object of reward name to weight")
    # cosmos-rl's rule: a weight <= 0 turns that reward off for this request.
    rewards = [name for name, weight in weights.items() if weight > 0]
    unknown = [name for name in rewards if name not in known]
    if unknown:
        raise _bad(
            f"`reward_fn` names unknown reward(s) {', '.join(map(repr, unknown))}: this service "
            f"runs {', '.join(known)}"
        )
    if not rewards:
        raise _bad("`reward_fn` names no reward with a weight > 0")
    media_type = header.get("media_type", "latent")
    if not isinstance(media_type, str) or media_type.lower() not in MEDIA_TYPES:
        raise _bad(f"unknown `media_type` {media_type!r}: one of {', '.join(MEDIA_TYPES)}")
    wrong = [name for name in rewards if (name in text_rewards) != text]
    if wrong:
        kind = "text" if text else "images and videos"
        raise _bad(
            f"`reward_fn` asks {', '.join(map(repr, wrong))} for {kind}: "
            + ('text rewards take media_type "text"' if not text else "they score pixels")
        )
    if text:
        return _parse_text(header, prompts, rewards)
    assert array is not None
    video_infos = header.get("video_infos", [])
    if not isinstance(video_infos, list) or not all(isinstance(v, dict) for v in video_infos):
        raise _bad('`video_infos` must be a list of objects (e.g. {"video_fps": 16.0})')
    try:  # echoed by every pull: it must go back out as JSON
        json.dumps(video_infos, allow_nan=False)
    except ValueError:
        raise _bad("`video_infos` holds a number JSON cannot carry (too large)") from None

    tensor, pixels = _pixels(_tensor(array), media_type.lower())
    if pixels.shape[0] != len(prompts):
        raise _bad(f"{pixels.shape[0]} samples but {len(prompts)} prompts")
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
            raise _bad(f'`{key}` must be a list of strings (media_type "text")')
        if len(value) != len(prompts):
            raise _bad(f"{len(value)} {key} but {len(prompts)} prompts")
        fields[key] = value
    if not prompts:
        raise _bad("no completions to score")
    input_info = {"media_type": "text", "count": len(prompts)}
    return EnqueueRequest(prompts, rewards, TextSamples(**fields), input_info)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A received array as a tensor: uint8 kept, other integers as int64, floats as they are."""
    if array.dtype.kind not in "uif" or array.dtype.itemsize > 8:
        raise _bad(f"the array's dtype {array.dtype} is not supported: send uint8 or floats")
    if array.size == 0:
        raise _bad(f"the array is empty (shape {list(array.shape)})")
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
                raise _bad("a uint8 latent array holds bfloat16 bytes: its last axis must be even")
            tensor = tensor.view(torch.bfloat16)
        elif not tensor.is_floating_point():
            raise _bad(
                f"latent samples must be floats in [-1, 1] (or bfloat16 bytes as uint8), got "
                f"{tensor.dtype}"
            )
        _layout(tensor, 5, 1, "latent samples [B, C=3, T, H, W]")
        if not bool(torch.isfinite(tensor).all()):
            raise _bad("the latent samples hold NaN or infinite values")
        return tensor, pixels_from_samples(tensor)
    if media_type == "video":
        _layout(tensor, 5, 1, "video [B, C=3, T, H, W] of values 0..255")
        return tensor, _bytes(tensor, "video")
    _layout(tensor, 4, 3, "images [B, H, W, C=3] of values 0..255")
    return tensor, _bytes(tensor, "image").permute(0, 3, 1, 2).unsqueeze(2).contiguous()


def _layout(tensor: torch.Tensor, dims: int, channel_axis: int, what: str) -> None:
    if tensor.dim() != dims or tensor.shape[channel_axis] != 3:
        raise _bad(f"expected {what}, got shape {list(tensor.shape)}")


def _bytes(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Values 0..255 as uint8 (rounded); anything else is refused, not wrapped around."""
    if tensor.dtype == torch.uint8:
        return tensor
    values = tensor.double()
    if not bool(torch.isfinite(values).all()) or values.min() < 0 or values.max() > 255:
        raise _bad(f"{what} values must lie in 0..255")
    return values.round().to(torch.uint8)


# --------------------------------------------------------------------------------------------
# Worker processes


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:2000]


def _call(fn: Any, name: str, samples: Samples, prompts: list[str]) -> dict[str, list[float]]:
    """`fn` on one batch (pixels in one call, texts one by one), its answer checked: one finite
    number per sample, under the reward's name; or, from a reward that returns a mapping (for
    the batch; a text reward: for each completion) of several scores of each sample, as
    cosmos-rl's `dance_grpo` gives `overall_reward`, `vq_reward`, ..., under each of its keys."""
    if isinstance(samples, TextSamples):
        pairs = zip(samples.completions, samples.references, strict=True)
        answer: Any = [fn(completion, reference) for completion, reference in pairs]
        if answer and all(isinstance(a, Mapping) for a in answer):  # (several per completion)
            answer = {key: [a.get(key, float("nan")) for a in answer] for key in answer[0]}
    else:
        answer = fn(torch.from_numpy(samples), prompts)
    named = dict(answer) if isinstance(answer, Mapping) else {name: answer}
    if not named:
        raise ValueError(f"reward {name} returned no scores")
    out = {}
    for key, scores in named.items():
        what = f"reward {name}" + ("" if key == name else f" (score {key!r})")
        if not isinstance(key, str):
            raise ValueError(f"reward {name} named a score {key!r}: score names are strings")
        if len(scores) != len(prompts):
            raise ValueError(f"{what} returned {len(scores)} scores for {len(prompts)} samples")
        out[key] = [float(s) for s in scores]
        bad = [i for i, s in enumerate(out[key]) if not np.isfinite(s)]
        if bad:
            raise ValueError(f"{what} returned a non-finite score for sample(s) {bad}")
    return out


_Outcome = tuple[dict[str, list[float]] | None, str | None, float]
"""(scores by name, error, seconds) of one task in a batch."""


def _joined(parts: list[Samples]) -> Samples:
    """Several tasks' samples as one batch."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], TextSamples):
        texts = [p for p in parts if isinstance(p, TextSamples)]
        return TextSamples(
            [c for p in texts for c in p.completions], [r for p in texts for r in p.references]
        )
    return np.concatenate([p for p in parts if isinstance(p, np.ndarray)])


def _score_batch(fn: Any, name: str, items: list[tuple[Samples, list[str]]]) -> list[_Outcome]:
    """Score the tasks `items` (samples, prompts) with one call of `fn`; split the scores back."""
    start = time.perf_counter()
    prompts = [p for _, ps in items for p in ps]
    try:
        scores = _call(fn, name, _joined([samples for samples, _ in items]), prompts)
    except Exception as err:
        if len(items) > 1:  # one task's input must not fail the tasks batched with it
            return [_score_batch(fn, name, [item])[0] for item in items]
        return [(None, _describe(err), time.perf_counter() - start)]
    seconds = time.perf_counter() - start
    out: list[_Outcome] = []
    offset = 0
    for array, _ in items:
        part = {key: values[offset : offset + len(array)] for key, values in scores.items()}
        out.append((part, None, seconds))
        offset += len(array)
    return out


def _worker_main(
    rewards: dict[str, bool], inbox: Any, results: Connection, parent_pid: int
) -> None:
    """A scoring process: import the rewards (name -> declared `text`), then score the batches
    of `inbox` until None."""
    # Ctrl-C reaches the whole process group; the service stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # several processes on few cores slow each other down otherwise
    fns = {name: resolve_reward(name, text=text) for name, text in rewards.items()}
    results.send(("ready", os.getpid()))
    while True:
        try:
            message = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the service died without stopping us
                return
            continue
        if message is None:
            return
        batch_id, name, items = message
        results.send(("done", batch_id, _score_batch(fns[name], name, items)))


# --------------------------------------------------------------------------------------------
# The service


@dataclass(eq=False)
class _Task:
    """One enqueued batch; one job per reward it asked for."""

    uuid: str
    prompts: list[str]
    pixels: Samples | None
    input_info: dict[str, Any]
    jobs: dict[str, _Job] = field(default_factory=dict)
    remaining: int = 0


@dataclass(eq=False)
class _Job:
    """One reward of one task: what a worker scores."""

    task: _Task
    reward: str
    attempts: int = 0
    running: bool = False
    done: bool = False
    scores: dict[str, list[float]] | None = None
    """Each sample's score by name (the reward's own, or the keys of a reward's mapping)."""
    error: str | None = None
    seconds: float = 0.0

    @property
    def size(self) -> int:
        """Samples in the job."""
        return len(self.task.prompts)

    @property
    def key(self) -> tuple[Any, ...]:
        """What jobs must share to be scored in one call: the reward and [C, T, H, W] (text:
        the reward)."""
        pixels = self.task.pixels
        assert pixels is not None
        return (
            (self.reward,) if isinstance(pixels, TextSamples) else (self.reward, *pixels.shape[1:])
        )


@dataclass(eq=False)
class _Slot:
    """A place in the worker pool and the process that fills it now."""

    index: int
    process: Any = None
    inbox: Any = None
    results: Connection | None = None
    pid: int | None = None
    ready: bool = False
    batch: list[_Job] | None = None
    batch_id: int = -1
    failures: int = 0
    retired: bool = False


class RewardService:
    """The queue, the worker processes that score it, and the results; no HTTP (see
    :func:`create_app`). Thread-safe; `start` before use, `stop` after."""

    def __init__(self, cfg: RewardServiceConfig) -> None:
        self.cfg = cfg
        self.rewards = cfg.rewards
        self.text_rewards = cfg.text_rewards
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._tasks: dict[str, _Task] = {}
        self._expiry: deque[tuple[float, str]] = deque()
        self._unfinished = 0
        self._slots = [_Slot(i) for i in range(cfg.num_workers)]
        self._batch_ids = itertools.count()
        self._calls: Counter[str] = Counter()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._dead_reason = ""

    # -- life cycle

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the workers and the supervisor; return once every worker is ready."""
        with self._lock:
            for slot in self._slots:
                self._spawn(slot)
        self._supervisor = threading.Thread(
            target=self._supervise, name="reward-supervisor", daemon=True
        )
        self._supervisor.start()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if all(s.retired for s in self._slots):
                    reason = self._dead_reason
                    break
                if all(s.ready or s.retired for s in self._slots):
                    return
            if time.monotonic() > deadline:
                reason = f"workers not ready within {timeout_s:.0f} s"
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"the reward service could not start: {reason}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the supervisor and the workers (asked first, then terminated)."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout_s)
        with self._lock:
            slots = [s for s in self._slots if s.process is not None]
            for slot in slots:
                if slot.batch is not None:  # nobody will pull what it is scoring
                    slot.process.terminate()
                elif slot.process.is_alive():
                    slot.inbox.put(None)
        deadline = time.monotonic() + timeout_s
        for slot in slots:
            slot.process.join(max(0.0, deadline - time.monotonic()))
            if slot.process.is_alive():
                log.warning(
                    "reward worker %d (pid %s) did not stop; killing it", slot.index, slot.pid
                )
                slot.process.kill()
                slot.process.join(5.0)
        with self._lock:
            for slot in slots:
                self._close(slot)
                slot.process = None

    # -- requests

    def submit(self, request: EnqueueRequest) -> str:
        """Queue `request`; its uuid. Raises :class:`RequestError` 429 when `max_pending` tasks
        are waiting or running, 503 when no worker is alive."""
        with self._lock:
            if self._stopping.is_set():
                raise RequestError(503, "the reward service is stopping")
            if all(s.retired for s in self._slots):
                raise RequestError(503, f"no scoring worker is alive: {self._dead_reason}")
            if self._unfinished >= self.cfg.max_pending:
                raise RequestError(
                    429,
                    f"{self._unfinished} tasks are waiting or being scored (max_pending = "
                    f"{self.cfg.max_pending}); retry later",
                    {"Retry-After": "1"},
                )
            task = _Task(str(uuidlib.uuid4()), request.prompts, request.pixels, request.input_info)
            for name in request.rewards:
                task.jobs[name] = _Job(task, name)
            task.remaining = len(task.jobs)
            self._tasks[task.uuid] = task
            self._unfinished += 1
            self._queue.extend(task.jobs.values())
            self._dispatch()
        log.debug("queued %s: %d samples for %s", task.uuid, len(task.prompts), request.rewards)
        return task.uuid

    def result(self, uuid: str, reward: str | None) -> dict[str, Any]:
        """The pull answer for `reward` of task `uuid`; raises :class:`RequestError`: 400 "Not
        found scores" while not ready (or unknown, or expired), 422 when scoring failed."""
        with self._lock:
            task = self._tasks.get(uuid)
            if task is None:
                raise RequestError(400, f"Not found scores for {uuid}")
            if reward is None:
                if len(task.jobs) != 1:
                    raise _bad(f"give the form field `type`: one of {', '.join(task.jobs)}")
                reward = next(iter(task.jobs))
            job = task.jobs.get(reward)
            if job is None:
                raise _bad(
                    f"reward {reward!r} was not asked for task {uuid}; it asked for "
                    f"{', '.join(task.jobs)}"
                )
            if not job.done:
                raise RequestError(400, f"Not found scores for {uuid}")
            if job.error is not None:
                raise _bad(f"scoring failed: {job.error}")
            return {
                "scores": job.scores,
                "input_info": task.input_info,
                "duration": job.seconds,
                "type": reward,
            }

    def stats(self) -> dict[str, Any]:
        """Load and workers, for the ping endpoint and tests."""
        with self._lock:
            live = [s for s in self._slots if s.process is not None and s.ready]
            return {
                "pending": self._unfinished,
                "queued": len(self._queue),
                "running": sum(len(s.batch or ()) for s in self._slots),
                "workers": sum(1 for s in live if s.process.is_alive()),
                "worker_pids": [s.pid for s in live],
                "calls": dict(self._calls),
                "rewards": list(self.rewards),
            }

    # -- inside (callers hold self._lock)

    def _spawn(self, slot: _Slot) -> None:
        reader, writer = self._ctx.Pipe(duplex=False)
        slot.inbox = self._ctx.Queue()
        slot.process = self._ctx.Process(
            target=_worker_main,
            args=(
                {a.reward_type: a.text for a in self.cfg.reward_args if a.enable},
                slot.inbox,
                writer,
                os.getpid(),
            ),
            name=f"reward-worker-{slot.index}",
            daemon=True,
        )
        slot.process.start()
        # The worker holds the only write end, so its death reads as EOF here.
        writer.close()
        slot.results, slot.pid, slot.ready, slot.batch = reader, slot.process.pid, False, None

    def _close(self, slot: _Slot) -> None:
        if slot.results is not None:
            slot.results.close()
            slot.results = None
        if slot.inbox is not None:
            # (a message a dead worker never read must not keep this process from exiting)
            slot.inbox.cancel_join_thread()
            slot.inbox.close()
            slot.inbox = None

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                waitables: list[Any] = [s.results for s in self._slots if s.results is not None]
                waitables += [s.process.sentinel for s in self._slots if s.process is not None]
            if waitables:
                wait_ready(waitables, timeout=0.05)
            else:
                time.sleep(0.05)
            with self._lock:
                if self._stopping.is_set():
                    return
                try:
                    self._collect()
                    self._reap()
                    self._dispatch()
                    self._expire()
                except Exception:  # a bug here must not leave every task waiting forever
                    log.exception("reward service supervisor error")

    def _collect(self) -> None:
        """Take the workers' messages (readiness, finished batches)."""
        for slot in self._slots:
            while slot.results is not None and slot.results.poll():
                try:
                    message = slot.results.recv()
                except (EOFError, OSError):  # the worker is gone; `_reap` handles it
                    slot.results.close()
                    slot.results = None
                    break
                if message[0] == "ready":
                    slot.ready, slot.failures = True, 0
                    log.debug("reward worker %d ready (pid %s)", slot.index, message[1])
                elif (
                    message[0] == "done" and slot.batch is not None and message[1] == slot.batch_id
                ):
                    for job, (scores, error, seconds) in zip(slot.batch, message[2], strict=True):
                        self._finish(job, scores, error, seconds)
                    slot.batch = None

    def _reap(self) -> None:
        """Replace dead workers; the tasks they held go back to the front of the queue."""
        for slot in self._slots:
            if slot.process is None or slot.retired or slot.process.is_alive():
                continue
            why = _exit_reason(slot.process.exitcode)
            batch, slot.batch = slot.batch or [], None
            retry = []
            for job in batch:
                job.running = False
                if job.attempts >= self.cfg.max_attempts:
                    self._finish(
                        job,
                        None,
                        f"worker died ({why}) while scoring it; gave up after {job.attempts} "
                        f"attempts (max_attempts = {self.cfg.max_attempts})",
                        0.0,
                    )
                else:
                    retry.append(job)
            self._queue.extendleft(reversed(retry))
            held = ", ".join(f"{j.task.uuid}/{j.reward}" for j in batch) or "nothing"
            log.warning(
                "reward worker %d (pid %s) died (%s) holding %s; %d task(s) requeued",
                slot.index,
                slot.pid,
                why,
                held,
                len(retry),
            )
            slot.failures = slot.failures + 1 if not slot.ready else 0
            self._close(slot)
            slot.process = None
            if slot.failures >= MAX_START_FAILURES:
                slot.retired = True
                self._dead_reason = (
                    f"worker {slot.index} died {slot.failures} times before it was ready (last: "
                    f"{why}); see its output above"
                )
                log.error("reward worker %d given up: %s", slot.index, self._dead_reason)
                continue
            self._spawn(slot)
        if all(s.retired for s in self._slots):
            while self._queue:
                job = self._queue.popleft()
                self._finish(job, None, f"no scoring worker is alive: {self._dead_reason}", 0.0)

    def _dispatch(self) -> None:
        """Give each idle worker a batch: the oldest job and queued jobs of its reward and sample
        shape, up to `max_batch_samples` samples."""
        for slot in self._slots:
            if not self._queue:
                return
            if not slot.ready or slot.batch is not None or slot.inbox is None:
                continue
            first = self._queue.popleft()
            batch, size, keep = [first], first.size, deque[_Job]()
            for job in self._queue:
                if job.key == first.key and size + job.size <= self.cfg.max_batch_samples:
                    batch.append(job)
                    size += job.size
                else:
                    keep.append(job)
            self._queue = keep
            for job in batch:
                job.attempts += 1
                job.running = True
            slot.batch, slot.batch_id = batch, next(self._batch_ids)
            self._calls[first.reward] += 1
            items = [(job.task.pixels, job.task.prompts) for job in batch]
            slot.inbox.put((slot.batch_id, first.reward, items))

    def _finish(
        self,
        job: _Job,
        scores: dict[str, list[float]] | None,
        error: str | None,
        seconds: float,
    ) -> None:
        job.scores, job.error, job.seconds = scores, error, seconds
        job.running, job.done = False, True
        task = job.task
        if error is not None:
            log.warning("scoring %s of %s failed: %s", job.reward, task.uuid, error)
        task.remaining -= 1
        if task.remaining == 0:
            task.pixels = None  # the scores stay for result_ttl_s; the pixels need not
            self._unfinished -= 1
            self._expiry.append((time.monotonic() + self.cfg.result_ttl_s, task.uuid))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            self._tasks.pop(self._expiry.popleft()[1], None)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# --------------------------------------------------------------------------------------------
# HTTP


class _BearerGuard:
    """ASGI middleware: the token check (all but `/health`), before anything is read or parsed;
    tokens are compared in constant time and never logged."""

    def __init__(self, app: ASGIApp, *, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] != HEALTH_PATH
            and not bearer_matches(scope, self.token)
        ):
            body = json.dumps({"message": "missing or invalid bearer token"}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the body exceeds {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _form(request: Request) -> dict[str, str]:
    """The url-encoded form fields of the body (first value of each)."""
    if request.headers.get("content-type", "").startswith("multipart/"):
        raise RequestError(
            415, "send the form fields url-encoded (application/x-www-form-urlencoded)"
        )
    body = await _read_body(request, MAX_FORM_BYTES)
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=16)
    except (UnicodeDecodeError, ValueError) as err:
        raise RequestError(400, f"the body is not a url-encoded form: {err}") from None
    return {key: values[0] for key, values in fields.items()}


def create_app(service: RewardService, *, token: str) -> FastAPI:
    """The HTTP API over `service`: enqueue, pull, ping (bearer `token`) and `/health`."""
    if not token:
        raise ValueError("the reward service needs a non-empty bearer token")
    app = FastAPI(title="nebula-rl reward service", docs_url=None, redoc_url=None)
    app.add_middleware(_BearerGuard, token=token)
    max_body = int(service.cfg.max_body_mb * (1 << 20))

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse({"message": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback; the caller gets no internals.
        return JSONResponse({"message": "internal server error"}, status_code=500)

    @app.get(HEALTH_PATH)
    def health() -> dict[str, str]:
        """Liveness probe; needs no token."""
        return {"status": "ok"}

    @app.post(ENQUEUE_PATH)
    async def enqueue(request: Request) -> dict[str, str]:
        """Queue a batch (`<JSON>\\n<npy bytes>`) for scoring; its uuid."""
        body = await _read_body(request, max_body)
        parsed = await run_in_threadpool(parse_enqueue, body, service.rewards, service.text_rewards)
        return {"uuid": service.submit(parsed)}

    @app.post(PULL_PATH)
    async def pull(request: Request) -> dict[str, Any]:
        """One reward's scores of a task (form `uuid`, `type`); 400 while not ready."""
        form = await _form(request)
        if not form.get("uuid"):
            raise _bad("the form field `uuid` is missing")
        return service.result(form["uuid"], form.get("type") or None)

    @app.post(PING_PATH)
    async def ping(request: Request) -> dict[str, Any]:
        """Whether the service runs, and its load (form `info_data` optional, logged)."""
        info = (await _form(request)).get("info_data")
        if info:
            log.debug("ping: %s", info[:1000])
        return {"status": "ok", **service.stats()}

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (0: any free port); a port in use is a `ValueError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} ({err.strerror}): free the port or choose another "
            "`port` (--port); the service does not move to another port by itself"
        ) from None
    sock.set_inheritable(True)
    return sock


@dataclass
class RunningService:
    """A reward service answering HTTP from a background thread (tests, embedding)."""

    service: RewardService
    """The queue and the workers."""
    http: HttpServer
    """The HTTP server and its thread."""
    token: str
    """The bearer token clients must send."""

    @property
    def url(self) -> str:
        """`http://host:port`."""
        return self.http.url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the HTTP server, then the workers."""
        try:
            self.http.stop(timeout_s)
        finally:
            self.service.stop(timeout_s)

    def __enter__(self) -> RunningService:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_service(
    cfg: RewardServiceConfig, *, token: str | None = None, timeout_s: float = 120.0
) -> RunningService:
    """Start the workers and serve HTTP in a daemon thread; returns once both are ready."""
    token = token or resolve_token(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    service = RewardService(cfg)
    try:
        service.start(timeout_s)
    except BaseException:
        sock.close()
        raise
    try:
        http = serve(
            create_app(service, token=token), host=cfg.host, sock=sock, timeout=timeout_s,
            name="reward-service-http", lifespan="off",
        )  # fmt: skip
    except BaseException:
        service.stop()
        raise
    return RunningService(service, http, token)


def _uvicorn(app: FastAPI) -> uvicorn.Server:
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, server_header=False, lifespan="off"
    )
    return uvicorn.Server(config)


def run_service(cfg: RewardServiceConfig) -> None:
    """Serve in this (main) thread until SIGINT or SIGTERM, then stop the workers and return.

    A port in use is a `ValueError` before any worker starts."""
    token = resolve_token(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    server: uvicorn.Server | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if server is None:  # still starting the workers: give up starting
            raise KeyboardInterrupt
        # (uvicorn handles signals while it runs and raises them again after its shutdown)
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    service = RewardService(cfg)
    try:
        service.start()
        server = _uvicorn(create_app(service, token=token))
        log.info(
            "reward service on http://%s:%d: %s (%d worker(s), max_pending %d)",
            cfg.host,
            sock.getsockname()[1],
            ", ".join(service.rewards),
            cfg.num_workers,
            cfg.max_pending,
        )
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        log.info("interrupted while starting")
    finally:
        service.stop()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("reward service stopped")
