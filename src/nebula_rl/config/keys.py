"""Reading a config tree by dotted key: the keys a user wrote, a key's value, default and refusal."""

from __future__ import annotations

import json
from typing import Any

from pydantic import (
    BaseModel,
)

from nebula_rl.config.job import Config


def flat_keys(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf the user wrote (free-form tables are one leaf)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in ("custom",) and value:
            out |= flat_keys(value, dotted + ".")
        else:
            out[dotted] = value
    return out


def value_at(model: BaseModel, dotted: str) -> tuple[bool, Any, Any, dict[str, Any] | None]:
    """(found, value in force, default, refused-metadata of it or of a section holding it)."""
    node: Any = model
    refusal = None
    default: Any = None
    for part in dotted.split("."):
        if not isinstance(node, BaseModel) or part not in type(node).model_fields:
            return False, None, None, None
        field = type(node).model_fields[part]
        extra = field.json_schema_extra
        if refusal is None and isinstance(extra, dict) and "refused" in extra:
            refusal = extra
        default = field.get_default(call_default_factory=True)
        node = getattr(node, part)
    return True, node, default, refusal


def format_value(value: Any) -> str:
    """A value as TOML-ish JSON text (`true`, `"fp8"`, `[1, 2]`)."""
    from pydantic_core import to_jsonable_python

    return json.dumps(to_jsonable_python(value))


def within_default_mapping(cfg: Config, dotted: str) -> bool:
    """Whether `dotted` names an entry inside a mapping field (e.g. `media_settings.video.fps`)
    whose whole value is its default."""
    parts = dotted.split(".")
    for end in range(len(parts) - 1, 0, -1):
        found, value, default, _ = value_at(cfg, ".".join(parts[:end]))
        if found:
            return isinstance(value, dict) and value == default
    return False


def section_default(cfg: Config, dotted: str) -> Any:
    """The default of `dotted` inside the default of the refused section that holds it (a key
    of, e.g., `[distillation]` is compared with the default distillation section's value)."""
    parts = dotted.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        field = type(node).model_fields.get(part) if isinstance(node, BaseModel) else None
        if field is None:
            return None
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "refused" in extra and i < len(parts) - 1:
            section = field.get_default(call_default_factory=True)
            for rest in parts[i + 1 :]:
                if not isinstance(section, BaseModel):
                    return None
                section = getattr(section, rest, None)
            return section
        node = getattr(node, part)
    return None
