"""The modality seam: which kind of model a job trains is tested in one place, and each role
gets the language or world-model part from it."""

from __future__ import annotations

import ast
from pathlib import Path

from flow_configs import tiny_flow_config, tiny_flow_policy
from nebula_rl.config import config_from_dict
from nebula_rl.modality import for_config

SRC = Path(__file__).resolve().parents[1] / "src" / "nebula_rl"


def test_only_the_seam_reads_is_diffusers():
    """Outside the config tree (which defines and checks the key) and `modality/__init__.py`,
    no code reads `.is_diffusers`."""
    readers = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "config" or rel == Path("modality/__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "is_diffusers":
                readers.append(f"{rel}:{node.lineno}")
    assert readers == []


def test_the_modality_follows_the_config(tmp_path):
    text = for_config(config_from_dict({}))
    world = for_config(config_from_dict(tiny_flow_config(tmp_path, tiny_flow_policy())))
    assert (text.name, world.name) == ("text", "world")
    # A colocated world model runs in `nebula-rl train`'s ranks; a language model's policy
    # replicas generate under a controller.
    assert world.colocated_in_one_job and not text.colocated_in_one_job
    assert "pickscore" in world.fetched_datasets() and not text.fetched_datasets()
