"""The config reference (docs/config-reference.md) is generated from the config tree and must be
current."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nebula_rl.cli import main
from nebula_rl.config import Config
from nebula_rl.config import reference as config_reference

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"


def _keys(model: type = Config, path: str = "") -> set[str]:
    """Every value key of the config tree as `section.key`, found by walking the models."""
    keys = set()
    for section in config_reference.sections(model, path):
        for name, field in section.model.model_fields.items():
            if not config_reference._model_members(field.annotation):
                keys.add(f"{section.path}.{name}" if section.path else name)
    return keys


def test_the_reference_is_current() -> None:
    assert config_reference.is_current(REFERENCE), (
        "docs/config-reference.md is out of date: run "
        "`.venv/bin/nebula-rl config-reference --write docs/config-reference.md`"
    )


def test_every_key_is_documented_once_per_table() -> None:
    text = config_reference.render()
    tables = re.split(r"^#### ", text, flags=re.MULTILINE)[1:]
    rendered = set()
    for table in tables:
        heading = table.splitlines()[0]
        match = re.match(r"`\[([\w.]+)\]`", heading)
        section = match.group(1) if match else ""
        names = re.findall(r"^\| `(\w+)` \| `[^`]+` \| `[^`]*` \| (.+) \|$", table, re.MULTILINE)
        for name, meaning in names:
            assert meaning.strip(), f"{section}.{name} has no docstring in src/nebula_rl/config/"
            rendered.add(f"{section}.{name}" if section else name)
    # A model used by several tables (the dataset, the parallelism of the teacher, LoRA) is
    # documented at its first table and referred to from the others.
    first: dict[type, str] = {}
    for section in config_reference.sections():
        first.setdefault(section.model, section.path)
    repeated = [s.path + "." for s in config_reference.sections() if first[s.model] != s.path]
    expected = {k for k in _keys() if not k.startswith(tuple(repeated))}
    assert (
        "validation.dataset.name" not in expected and "train.train_policy.dataset.name" in expected
    )
    assert rendered == expected
    assert "`logging.wandb_mode`" not in text  # keys appear in their table, not dotted
    assert '| `wandb_mode` | `"auto" \\| "online" \\| "offline"` | `"auto"` |' in text
    assert "| `port` | `int, >= 0, <= 65535` | `0` |" in text


def test_check_fails_on_a_stale_copy_and_write_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "config-reference.md"
    current = config_reference.splice(REFERENCE.read_text(), config_reference.render())
    stale = current.replace("Adam betas.", "Adam's betas.")
    assert stale != current
    copy.write_text(stale)
    assert main(["config-reference", "--check", str(copy)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert copy.read_text() == stale  # --check changes nothing
    assert main(["config-reference", "--write", str(copy)]) == 0
    assert copy.read_text() == current
    assert main(["config-reference", "--check", str(copy)]) == 0


def test_a_file_without_markers_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain.md"
    plain.write_text("# nothing here\n")
    assert main(["config-reference", "--write", str(plain)]) == 2
    assert "markers" in capsys.readouterr().err
    assert plain.read_text() == "# nothing here\n"
