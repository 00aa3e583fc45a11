"""Loading a config: TOML or a run's resolved JSON, through cosmos-rl's compatibility, validation
and refusals.
"""

from __future__ import annotations

import copy
import json
import logging
import tomllib
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from nebula_rl.config.algorithm import VARIANT_DEFAULTS, GrpoConfig
from nebula_rl.config.base import ConfigError
from nebula_rl.config.compat.cosmos import TRAINER_ALIASES, pop_stale
from nebula_rl.config.compat.wfm import check_wfm
from nebula_rl.config.errors import format_errors
from nebula_rl.config.job import Config
from nebula_rl.config.keys import flat_keys, format_value
from nebula_rl.config.refusals import refusals

log = logging.getLogger(__name__)


def config_from_dict(
    data: dict[str, Any], *, source: str = "<dict>", resolved: bool = False
) -> Config:
    """Validate a parsed config; errors raise :class:`ConfigError` naming `source` and the key.

    `resolved` marks a config nebula-rl wrote itself (a run's `config.json`, the controller's
    copy): it was checked for refusals when the job started, and its values include the side
    effects of its keys."""
    model = data.get("model")
    if "num_gpus" in data or (isinstance(model, dict) and "model_name" in model):
        key = "num_gpus" if "num_gpus" in data else "model.model_name"
        raise ConfigError(
            f"{source}: {key} is a key of an eval config, not of a training config: run it "
            "with `nebula-rl eval --config` (docs/evaluation.md)"
        )
    data = check_wfm(copy.deepcopy(data), source)
    warnings = pop_stale(data)
    user_keys = flat_keys(data)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err, source)) from None
    if not resolved:
        problems = refusals(cfg, user_keys)
        if problems:
            raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
        cfg._warnings = warnings + _noted_effects(cfg, user_keys)
    return cfg


def _noted_effects(cfg: Config, user_keys: dict[str, Any]) -> list[str]:
    """Values in force that differ from what the user wrote or left to the default."""
    notes = []
    policy = cfg.train.train_policy
    if TRAINER_ALIASES.get(policy.trainer_type) == policy.type:
        notes.append(
            f"train.train_policy.trainer_type = {json.dumps(policy.trainer_type)}: cosmos-rl's "
            f"example of a registered trainer, its {policy.type} trainer unchanged; nebula-rl's "
            f"{policy.type} trainer runs it"
        )
    if isinstance(policy, GrpoConfig):
        for key, value in VARIANT_DEFAULTS[policy.variant].items():
            if f"train.train_policy.{key}" not in user_keys:
                notes.append(
                    f"train.train_policy.{key} = {format_value(value)} (variant "
                    f'"{policy.variant}"\'s default)'
                )
        written = user_keys.get("train.train_policy.allowed_outdated_steps")
        if written is not None and written != policy.allowed_outdated_steps:
            notes.append(
                f"train.train_policy.allowed_outdated_steps = {policy.allowed_outdated_steps} "
                f"(not {written}: on_policy, or sync_weight_interval "
                f"{cfg.train.sync_weight_interval} needs at least sync_weight_interval - 1)"
            )
    return notes


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML config file (or a `.json` resolved config)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    if path.suffix == ".json":  # a resolved config, as written into every run folder
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: invalid JSON: {err}") from None
        return config_from_dict(data, source=str(path), resolved=True)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    cfg = config_from_dict(data, source=str(path))
    for warning in cfg.warnings:
        log.warning("%s: %s", path, warning)
    return cfg
