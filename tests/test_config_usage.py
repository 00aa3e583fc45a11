"""No config key is parsed and then ignored.

Every field of the config tree is either read by code (an attribute access `.name`, or the key
`"name"` given to a dict lookup, in a function of `src/nebula_rl/`), or refused at any value but
its default (`refused(...)` metadata, which `refusals` turns into an error naming the key). The
test walks the tree and reads the source with `ast`, so docstrings and comments do not count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from nebula_rl.config import Config, ConfigError, config_from_dict
from nebula_rl.config import reference as config_reference

SRC = Path(__file__).resolve().parents[1] / "src" / "nebula_rl"


def _references() -> set[str]:
    """Attribute names and string keys that code in src/ uses (outside the config reference,
    which only documents the tree)."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        if path == SRC / "config" / "reference.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("get", "pop", "setdefault") and node.args:
                    first = node.args[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str):
                        names.add(first.value)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                if isinstance(node.slice.value, str):
                    names.add(node.slice.value)
            elif (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Constant)
                and isinstance(node.left.value, str)
            ):  # `"key" in table`
                names.add(node.left.value)
    return names


def _fields() -> list[tuple[str, str, bool]]:
    """(dotted key, field name, refused) of every value key of the tree, once per model; the keys
    of a whole refused section (e.g. `[distillation]`) count as refused."""
    out, seen, refused_sections = [], set(), []
    for section in config_reference.sections():
        inside_refused = any(section.path.startswith(r) for r in refused_sections)
        if section.model in seen:
            continue
        seen.add(section.model)
        for name, field in section.model.model_fields.items():
            members = config_reference._model_members(field.annotation)
            extra = field.json_schema_extra
            refused = inside_refused or (isinstance(extra, dict) and "refused" in extra)
            key = f"{section.path}.{name}".lstrip(".")
            if not members:
                out.append((key, name, refused))
            elif refused:
                refused_sections.append(key)
    return out


def test_every_config_field_is_read_by_code_or_refused() -> None:
    used = _references()
    unread = [key for key, name, refused in _fields() if not refused and name not in used]
    assert unread == []


def _default_walk(model: type[BaseModel], prefix: str) -> list[tuple[str, object]]:
    out = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "refused" in extra:
            default = field.get_default(call_default_factory=True)
            if not isinstance(default, BaseModel):
                out.append((f"{prefix}{name}", default))
    return out


def _other_value(default: object) -> object:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default + 0.5
    return None


@pytest.mark.parametrize(
    ("key", "default"),
    [
        (f"{s.path}.{k}".lstrip("."), d)
        for s in config_reference.sections()
        for k, d in _default_walk(s.model, "")
        if _other_value(d) is not None and s.path != "train.train_policy"
    ],
)
def test_a_refused_key_at_another_value_is_an_error_naming_it(key: str, default: object) -> None:
    """Each refused key set to another value than its default: a ConfigError naming the key and
    the value (the world-model and VLA tables are refused the same way, key by key)."""
    data: dict = {}
    *parents, leaf = key.split(".")
    table = data
    for part in parents:
        table = table.setdefault(part, {})
    table[leaf] = _other_value(default)
    with pytest.raises(ConfigError, match=re.escape(key) + " = .*: .+"):
        config_from_dict(data)


def test_refused_policy_keys_are_errors_too() -> None:
    for policy in ("grpo", "sft"):
        for key, value in (("data_dispatch_as_rank_in_mesh", True), ("enable_dataset_cache", True)):
            with pytest.raises(ConfigError, match=rf"train\.train_policy\.{key} = true: "):
                config_from_dict({"train": {"train_policy": {"type": policy, key: value}}})


def test_the_walk_sees_the_whole_tree() -> None:
    keys = [key for key, _, _ in _fields()]
    assert len(keys) > 200
    assert "train.train_policy.min_filter_prefix_tokens" in keys  # a GRPO key
    assert "train.train_policy.conversation_column_name" in keys  # an SFT key
    assert Config.model_fields  # (the tree's root)
