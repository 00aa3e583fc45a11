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
    assert "pickscore" in world.fetched_datasets() and not text.fetched_datasets()


def test_check_names_the_world_models_colocated_layouts(tmp_path):
    """`nebula-rl check`'s layout note for world-model RL: rollout replicas, a colocated replica
    under the controller, or the uncentralized run in one job."""
    from types import SimpleNamespace

    def note(**changes: object) -> str:
        raw = tiny_flow_config(tmp_path, tiny_flow_policy(), **changes.pop("policy_keys", {}))  # type: ignore[arg-type]
        raw |= changes
        raw["policy"]["parallelism"] = {"dp_shard_size": 2}
        cfg = config_from_dict(raw)
        report = SimpleNamespace(errors=[], notes=[])
        for_config(cfg).check_layout(cfg, report, num_policy=1, num_rollout=2)
        assert report.errors == []
        return " ".join(n for n in report.notes if n.startswith("layout:"))

    assert "1 policy replica(s) of 2 process(es) (FSDP2-sharded) and 2 rollout" in note()
    assert "1 colocated policy replica(s) of 2 process(es)" in note(mode="colocated")
    unc = note(mode="colocated", policy_keys={"uncentralized_training": True})
    assert "trains on 2 rank(s), FSDP2-sharded, sampling its own rollouts in this job" in unc
