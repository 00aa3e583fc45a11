"""The config reference: every key of the config tree with its type, default and docstring.

Rendered as Markdown from :mod:`nebula_rl.config` itself, so it cannot drift.

`nebula-rl config-reference` prints it; `--write docs/config-reference.md` replaces what lies
between :data:`START` and :data:`END` there; `--check docs/config-reference.md` fails when that
copy is stale (a test runs the check).
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from nebula_rl.config import Config

__all__ = ["END", "START", "Section", "is_current", "render", "sections", "splice", "write"]

START = "<!-- config-reference:start -->"
"""Marker before the generated text."""
END = "<!-- config-reference:end -->"
"""Marker after it."""


@dataclass(frozen=True)
class Section:
    """One TOML table of the config tree."""

    path: str
    """Dotted name (`train.train_policy`); empty for the top level."""
    model: type[BaseModel]
    """The pydantic model of the table."""
    variant: str = ""
    """For a member of a union discriminated by `type`: its `type` value."""


def _model_members(annotation: Any) -> list[type[BaseModel]]:
    """The config models a field holds: one for a sub-table, several for a union of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in get_args(annotation) if isinstance(a, type)]
        if members and all(issubclass(a, BaseModel) for a in members):
            return members
    return []


def sections(
    model: type[BaseModel] = Config, path: str = "", variant: str = ""
) -> Iterator[Section]:
    """Every table under `model`, depth first in field order (a table before its sub-tables)."""
    yield Section(path, model, variant)
    for name, field in model.model_fields.items():
        members = _model_members(field.annotation)
        child = f"{path}.{name}" if path else name
        for member in members:
            tag = member.model_fields.get("type")
            label = str(tag.default) if len(members) > 1 and tag is not None else ""
            yield from sections(member, child, label)


def _leaf_fields(model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """The keys of a table that are values, not sub-tables."""
    return [(n, f) for n, f in model.model_fields.items() if not _model_members(f.annotation)]


def _type_name(annotation: Any) -> str:
    """A short, TOML-minded spelling of a field type."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "unset"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        optional = " (optional)" if type(None) in args else ""
        return " | ".join(names) + optional
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is tuple:
        return f"[{', '.join(_type_name(a) for a in args)}]"
    if origin is dict:
        return f"table[{_type_name(args[0])} -> {_type_name(args[1])}]"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)


def _bounds(field: FieldInfo) -> str:
    """The numeric bounds a field enforces, e.g. `>= 1, <= 65535`."""
    parts = []
    for item in field.metadata:
        for kind, attr, symbol in _BOUNDS:
            if isinstance(item, kind):
                parts.append(f"{symbol} {getattr(item, attr)}")
    return ", ".join(parts)


def _toml(value: Any) -> str:
    """A default value as it would be written in TOML (`unset` for None)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(
            f"{json.dumps(k) if not k.isidentifier() else k} = {_toml(v)}" for k, v in value.items()
        )
        return "{" + items + "}" if items else "{}"
    return str(value)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _heading(section: Section) -> str:
    if not section.path:
        return "#### Top level"
    variant = f' (`type = "{section.variant}"`)' if section.variant else ""
    return f"#### `[{section.path}]`{variant}"


def _summary(model: type[BaseModel]) -> str:
    """The first paragraph of a model's docstring."""
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split())


def _table(model: type[BaseModel]) -> list[str]:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in _leaf_fields(model):
        kind = _type_name(field.annotation)
        bounds = _bounds(field)
        if bounds:
            kind += f", {bounds}"
        default = _toml(field.get_default(call_default_factory=True))
        rows.append(
            f"| `{name}` | `{_cell(kind)}` | `{_cell(default)}` | {_cell(field.description or '')} |"
        )
    return rows


def render() -> str:
    """The reference as Markdown, markers included."""
    intro = (
        "Every key of a job's TOML file, section by section (type, default, meaning), generated "
        "from the docstrings in `src/nebula_rl/config/` by `nebula-rl config-reference --write "
        "docs/config-reference.md`; a test fails when this copy is stale. Keys marked nebula-rl "
        "are not "
        "cosmos-rl's; `unset` means the key is left out."
    )
    lines = [START, "", *textwrap.wrap(intro, 100, break_on_hyphens=False)]
    first_path: dict[type[BaseModel], str] = {}
    for section in sections():
        if not _leaf_fields(section.model) or first_path.get(section.model) == section.path:
            continue
        summary = _summary(section.model)
        if section.model in first_path:  # e.g. the dataset tables: one table, said once
            summary += f" Same keys as `[{first_path[section.model]}]`."
        lines += ["", _heading(section), "", *textwrap.wrap(summary, 100, break_on_hyphens=False)]
        if section.model in first_path:
            continue
        first_path[section.model] = section.path
        lines += ["", *_table(section.model)]
    lines += ["", END]
    return "\n".join(lines) + "\n"


def splice(text: str, reference: str) -> str:
    """`text` with what lies between the markers (markers included) replaced by `reference`."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the markers {START!r} ... {END!r} are missing or out of order")
    return text[:start] + reference.rstrip("\n") + text[end + len(END) :]


def is_current(path: Path) -> bool:
    """Whether `path` holds the reference as :func:`render` makes it now."""
    text = path.read_text()
    return splice(text, render()) == text


def write(path: Path) -> None:
    """Regenerate the reference inside `path`'s markers."""
    path.write_text(splice(path.read_text(), render()))
