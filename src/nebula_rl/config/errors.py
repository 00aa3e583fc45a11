"""Validation errors as messages that name the file and the dotted key ("did you mean" for an
unknown key).
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import (
    BaseModel,
    ValidationError,
)

from nebula_rl.config.algorithm import GrpoConfig, SftConfig
from nebula_rl.config.job import Config
from nebula_rl.config.training import TrainingConfig


def _dotted(loc: tuple[int | str, ...]) -> str:
    # pydantic puts the union tag ("grpo"/"sft") into the location of discriminated members.
    parts = [str(p) for p in loc if p not in ("grpo", "sft")]
    return ".".join(parts)


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The config section at `loc` (a pydantic error location), if it is one."""
    model: type[BaseModel] = Config
    for part in loc:
        if part in ("grpo", "sft") and model is TrainingConfig:
            continue
        if not isinstance(part, str) or part not in model.model_fields:
            return None
        members = _section_types(model.model_fields[part].annotation)
        if not members:
            return None
        if len(members) > 1:  # the discriminated train_policy: both members' keys
            return None
        model = members[0]
    return model


def _section_types(annotation: Any) -> list[type[BaseModel]]:
    """The config section classes an annotation holds (unions and `X | None` included)."""
    args = getattr(annotation, "__args__", None)
    if args:
        return [m for a in args for m in _section_types(a)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    metadata = getattr(annotation, "__metadata__", None)
    if metadata is not None:
        return _section_types(annotation.__origin__)
    return []


def _suggestion(loc: tuple[int | str, ...]) -> str:
    """`; did you mean "x"?` for an unknown key, from the keys of its section."""
    if not loc or not isinstance(loc[-1], str):
        return ""
    parent = loc[:-1]
    names: list[str]
    if parent and parent[-1] in ("grpo", "sft"):
        model = GrpoConfig if parent[-1] == "grpo" else SftConfig
        names = list(model.model_fields)
    else:
        model_at = _model_at(parent)
        names = list(model_at.model_fields) if model_at is not None else []
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.75)
    return f'; did you mean "{close[0]}"?' if close else ""


def format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _suggestion(e["loc"])
        else:
            msg = e["msg"].removeprefix("Value error, ")
        where = f"{source}: {_dotted(e['loc'])}" if e["loc"] else source
        lines.append(f"{where}: {msg}")
    return "\n".join(lines)
