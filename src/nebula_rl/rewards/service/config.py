"""The reward service's configuration: its TOML file (`[[reward_args]]` entries, cosmos-rl's
keys, with what is not built refused by name), its token, and how a reward is named."""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from nebula_rl.config import ConfigError
from nebula_rl.config.base import Section
from nebula_rl.rewards.base import REWARDS, RewardFn, get_reward
from nebula_rl.rewards.judge import MODEL_REWARDS
from nebula_rl.rewards.visual import VISUAL_REWARDS, VisualReward

log = logging.getLogger(__name__)

TOKEN_ENV = "NEBULA_REWARD_TOKEN"
"""Environment variable the service reads its bearer token from (over the config's `token`)."""


# Configuration


def resolve_reward(spec: str, *, text: bool = False) -> VisualReward | RewardFn:
    """The reward function `spec` names: a key of `VISUAL_REWARDS`, a registered text reward
    (`nebula_rl.rewards.REWARDS`), or a `module.path:function` (of a text reward with `text`)."""
    if spec in VISUAL_REWARDS:
        return VISUAL_REWARDS[spec]
    if spec in MODEL_REWARDS:
        raise ValueError(f"{spec} loads a model: build it with build_reward (its model_path)")
    if spec in REWARDS or (text and ":" in spec):
        return get_reward(spec)
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: one of {', '.join(sorted(VISUAL_REWARDS))} (images and "
            f"videos), {', '.join(sorted(MODEL_REWARDS))} (images and videos, with a "
            f"model_path), {', '.join(sorted(REWARDS))} (text), or a 'module.path:function' "
            "import path"
        )
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import reward {spec!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not a function")
    return fn  # type: ignore[no-any-return]


def build_reward(args: RewardArgs) -> VisualReward | RewardFn:
    """The callable that scores for `args` (a model-based reward's, with its model loaded)."""
    if args.reward_type in MODEL_REWARDS:
        return MODEL_REWARDS[args.reward_type](
            args.model_path, dtype=args.dtype, device=args.device
        )
    return resolve_reward(args.reward_type, text=args.text)


def is_text_reward(spec: str, *, text: bool = False) -> bool:
    """Whether the reward `spec` scores text (a registered text reward, or an import path
    declared `text`) rather than pixels."""
    return spec in REWARDS or (text and spec not in VISUAL_REWARDS)


# What each cosmos-rl key of a `[[reward_args]]` entry would ask for, and the values that ask for
# nothing here (empty, or cosmos-rl's own default where that means "the service's environment").
_MODEL = "only a model-based reward (reasoner_judge) loads a model"
_REFUSED_ARGS: dict[str, tuple[str, frozenset[str]]] = {
    "venv_python": (
        "per-reward virtualenvs are not supported yet: every reward runs in the service's own "
        "Python",
        frozenset({"", "python"}),
    ),
    "model_path": (_MODEL, frozenset({""})),
    "download_path": (
        "models are fetched into the Hugging Face cache (HF_HOME), not a folder of the reward's",
        frozenset({""}),
    ),
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
    "work_dir": ("no reward writes files", frozenset({""})),
    "tmp_dir": ("no reward writes files", frozenset({""})),
}
_MODEL_ARGS = ("model_path", "dtype", "device")
"""The keys a model-based reward (`MODEL_REWARDS`) reads."""
_DTYPES = frozenset({"", "float32", "bfloat16", "float16"})
_REDIS = "results are kept in the service's memory; a Redis store is not supported yet"


class RewardArgs(Section):
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
    """cosmos-rl: the reward model: a model-based reward's (`reasoner_judge`: a vision-language
    model's folder, Hub id or preset), which it needs; empty for the others."""
    download_path: str = ""
    """cosmos-rl: where to download the reward model; empty only (the Hugging Face cache)."""
    dtype: str = ""
    """cosmos-rl: the reward model's dtype (float32, bfloat16, float16; empty: float32)."""
    device: str = ""
    """cosmos-rl: the reward model's device (`cpu`, `cuda`, `cuda:1`; empty: cpu)."""
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
        if value not in MODEL_REWARDS:  # (whose model loads in the workers)
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
        field = str(info.field_name)
        if field in _MODEL_ARGS and info.data.get("reward_type") in MODEL_REWARDS:
            if field == "dtype" and value not in _DTYPES:
                raise ValueError(f"{value!r}: one of {', '.join(sorted(_DTYPES - {''}))}")
            if field == "device" and value and value.split(":")[0] not in ("cpu", "cuda"):
                raise ValueError(f"{value!r}: cpu, cuda or cuda:<index>")
            return value
        reason, accepted = _REFUSED_ARGS[field]
        if value not in accepted:
            raise ValueError(f"{value!r}: {reason}")
        return value

    @model_validator(mode="after")
    def _model_given(self) -> RewardArgs:
        if self.reward_type in MODEL_REWARDS and not self.model_path:
            raise ValueError(
                f"{self.reward_type} needs model_path (its vision-language model: a folder, a "
                "Hub id or a tiny: preset)"
            )
        return self


class RewardServiceConfig(Section):
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
    from nebula_rl.utils.runs import write_private

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
