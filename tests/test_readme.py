"""The README stays a page people read, and true: its map of `src/nebula_rl/` lists every module and
package with the first sentence of its own docstring, its Status cells fit a line, it is short,
and every relative link of the README and the docs pages points at a file that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PACKAGE = ROOT / "src" / "nebula_rl"


def _first_sentence(docstring: str) -> str:
    """The docstring's first sentence: its first paragraph up to the first full stop."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    end = re.search(r"\.(\s|$)", paragraph)
    return paragraph[: end.start() + 1] if end else paragraph


def _rooms() -> dict[str, str]:
    """Each top-level module (`x.py`) and package (`x/`) of nebula_rl: its first sentence."""
    rooms = {}
    for path in PACKAGE.iterdir():
        source = path / "__init__.py" if path.is_dir() else path
        if path.name.startswith("__") or source.suffix != ".py" or not source.is_file():
            continue
        docstring = ast.get_docstring(ast.parse(source.read_text())) or ""
        rooms[path.name + ("/" if path.is_dir() else "")] = _first_sentence(docstring)
    return rooms


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_the_map_lists_every_module_with_its_own_first_sentence():
    listed = dict(
        re.findall(
            r"^- `([\w./]+)`: (.+)$", _section(README.read_text(), "Where things live"), re.M
        )
    )
    rooms = _rooms()
    assert sorted(listed) == sorted(rooms), "README's map and src/nebula_rl/ differ"
    for name, caption in rooms.items():
        assert caption, f"{name} has no docstring"
        assert listed[name] == caption, f"{name}: the README says {listed[name]!r}"


def test_the_readme_is_short_and_its_status_cells_fit_a_line():
    text = README.read_text()
    assert len(text.splitlines()) <= 260
    rows = [row for row in _section(text, "Status").splitlines() if row.startswith("| ")][2:]
    assert len(rows) >= 15
    for row in rows:
        assert len(row) <= 180, row


def test_relative_links_point_at_files():
    pages = [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.name} links {target}, which is missing"
