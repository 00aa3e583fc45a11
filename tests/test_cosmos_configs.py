"""cosmos-rl's shipped configs (tests/data/cosmos-rl, copied unchanged) with `nebula-rl check`.

Every LLM config loads, or is refused only for a feature named in the issue that builds it
(FP8, the TensorRT-LLM backend) or in
the recorded exceptions below; the world-model, diffusion and robot-policy (VLA) configs are
refused naming their feature. docs/cosmos-rl-migration.md lists every config with the status this
test computes, so the page cannot drift.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from nebula_rl.config import ConfigError, config_from_dict, load_config
from nebula_rl.config.compat.wfm import translate_wfm

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "cosmos-rl"
MIGRATION = ROOT / "docs" / "cosmos-rl-migration.md"
CONFIGS = sorted(DATA.rglob("*.toml"))

NOT_LLM = ("cosmos-policy", "cosmos-predict2-5", "openvla-oft", "pi05", "sana", "stable-diff")
"""Folders of configs that train no language model (world models, diffusion, robot policies)."""

# Refusal message -> the feature it names (the first that matches).
FEATURES = [
    ("--wfm-mode", "world-model RL"),
    ("world-model", "diffusers models"),
    ("vision-language-action", "VLA"),
    ("LoRA", "LoRA"),
    ("colocated", "colocated mode"),
    ("distillation", "distillation"),
    ("FP8", "FP8"),
    ("TensorRT-LLM", "TensorRT-LLM backend"),
    ("expert parallelism", "expert parallelism"),
    ("MXFP4", "MXFP4 rollout weights"),
    ("EMA", "EMA"),
    ("remote rewards", "remote rewards"),
    ("image and video logging", "media logging"),
    ("non-text", "non-text completions"),
    ("trainer", "user-registered trainers"),
    ("rollout.parallelism", "rollout dp_shard_size"),
]

ALLOWED_FOR_LLM = {
    # The features the issue names as built later.
    "FP8",
    "TensorRT-LLM backend",
    # Recorded exceptions (see docs/cosmos-rl-migration.md): MoE expert parallelism for
    # DeepSeek-V3 and gpt-oss's MXFP4 rollout weights have no issue yet.
    "expert parallelism",
    "MXFP4 rollout weights",
}


def _features(error: ConfigError) -> list[str]:
    found = []
    for line in str(error).splitlines():
        line = line.split(": ", 1)[-1]  # (the file's path may hold a needle: a folder's name)
        name = next((name for needle, name in FEATURES if needle in line), None)
        assert name is not None, f"a refusal that names no known feature: {line}"
        if name not in found:
            found.append(name)
    return sorted(found)


def status(path: Path) -> str:
    """`loads`, or `refused: <features>` for one of the shipped configs."""
    try:
        load_config(path)
    except ConfigError as err:
        return "refused: " + ", ".join(_features(err))
    return "loads"


def _name(path: Path) -> str:
    return str(path.relative_to(DATA))


@pytest.mark.parametrize("path", CONFIGS, ids=_name)
def test_every_shipped_config_loads_or_names_what_it_needs(path: Path) -> None:
    got = status(path)
    if any(part in _name(path) for part in NOT_LLM) or "diffusion" in path.name:
        if got == "loads":  # (a world-model config whose every key nebula-rl reads)
            assert load_config(path).policy.is_diffusers, _name(path)
            return
        assert got.startswith("refused: "), got
        assert {"world-model RL", "diffusers models", "VLA"} & set(got[9:].split(", ")), got
    elif got != "loads":
        assert set(got.removeprefix("refused: ").split(", ")) <= ALLOWED_FOR_LLM, got


def test_most_llm_configs_load() -> None:
    llm = [p for p in CONFIGS if not any(part in _name(p) for part in NOT_LLM)]
    llm = [p for p in llm if "diffusion" not in p.name]
    loading = [p for p in llm if status(p) == "loads"]
    assert len(llm) == 36 and len(loading) >= 20, (len(llm), len(loading))


def test_the_migration_page_lists_every_config_with_its_status() -> None:
    rows = dict(re.findall(r"^\| `([^`]+\.toml)` \| ([^|]+?) \|", MIGRATION.read_text(), re.M))
    assert rows.keys() == {_name(p) for p in CONFIGS}
    for path in CONFIGS:
        assert rows[_name(path)] == status(path), _name(path)


def test_check_command_accepts_a_shipped_config_and_refuses_by_feature() -> None:
    ok = DATA / "configs" / "qwen3" / "qwen3-8b-p-tp4-r-tp2-pp1-grpo.toml"
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "check", "--config", str(ok)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert '"model_name_or_path": "Qwen/Qwen3-8B"' in result.stdout
    assert "layout: 8 device(s)" in result.stderr  # policy TP 4 + two rollout replicas of TP 2
    trtllm = DATA / "configs" / "qwen2-5" / "qwen2-5-7b-p-fsdp4-r-tp2-grpo-trtllm.toml"
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "check", "--config", str(trtllm)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert 'rollout.backend = "trtllm": the TensorRT-LLM backend' in result.stderr


def test_stale_keys_are_accepted_with_a_warning_that_names_them() -> None:
    cfg = load_config(DATA / "configs" / "qwen3" / "qwen3-32b-tp8-sft.toml")
    assert any(w.startswith("policy.model_gradient_checkpointig: ignored") for w in cfg.warnings)
    cfg = load_config(DATA / "configs" / "gemma" / "gemma3-12b-vlm-fsdp4-sft.toml")
    assert any("cp_rotate_method" in w for w in cfg.warnings)


def _flat(data: dict, prefix: str = "") -> dict:
    free_form = ("custom", "reward_function", "optm_lr", "kwargs", "trainable_map")
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in free_form:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_the_defaults_that_differ_are_listed(kind: str) -> None:
    """cosmos-rl's defaults (dumped from its schema, tests/data/cosmos-rl/defaults-*.json) against
    nebula-rl's: every difference is in the migration page's table."""
    import json

    from nebula_rl.config import config_from_dict

    theirs = _flat(json.loads((DATA / f"defaults-{kind}.json").read_text()))
    ours = _flat(
        config_from_dict({"train": {"train_policy": {"type": kind}}}).model_dump(mode="json")
    )
    differ = {k for k in theirs if k in ours and ours[k] != theirs[k]}
    listed = set(re.findall(r"^\| `([\w.]+)` \| .+ \| .+ \| .+ \|$", MIGRATION.read_text(), re.M))
    assert differ <= listed, sorted(differ - listed)
    assert len(theirs) > 150 and not {k for k in theirs if k not in ours} - {
        # cosmos-rl copies the training remote-reward table into validation; unset here
        f"validation.remote_reward.{k}"
        for k in ("batch_size", "reward_clip_max", "reward_clip_min", "reward_fns", "scale")
    }


def test_the_cosmos_reason_sft_recipe_loads_with_its_pre_validation_keys_noted(tmp_path) -> None:
    """Cosmos-Reason1's SFT recipe (the Cosmos-Reason2 post-training recipe) still carries the
    validation keys cosmos-rl's [validation] table replaced, and a free-form [custom] table."""
    path = tmp_path / "reason_sft.toml"
    path.write_text(
        'redis = "12800"\n'
        "[custom.dataset]\n"
        'media_path = "/data/train2017"\n'
        "[train]\n"
        "train_batch_per_replica = 32\n"
        "enable_validation = true\n"
        "validation_step = 30\n"
        "validation_batch_per_replica = 2\n"
        "[policy]\n"
        'model_name_or_path = "nvidia/Cosmos-Reason1-7B"\n'
        "[train.train_policy]\n"
        'type = "sft"\n'
        'conversation_column_name = "conversations"\n'
    )
    cfg = load_config(path)
    for key in ("enable_validation", "validation_step", "validation_batch_per_replica"):
        assert any(
            w.startswith(f"train.{key}: ignored, as cosmos-rl ignores it") for w in cfg.warnings
        )
    assert not cfg.validation.enable  # (ignored, as in cosmos-rl: [validation] decides)
    assert cfg.custom == {"dataset": {"media_path": "/data/train2017"}}


def test_a_wfm_mode_config_reads_key_by_key() -> None:
    """cosmos-rl's `--wfm-mode` schema: each key becomes the nebula-rl key that does the same,
    or is named with why not. One whose keys all translate (its model given by `[policy]`)
    loads as the world-model config of its translation, its rewards those of the reward
    service."""
    shipped = (
        DATA
        / "configs"
        / "cosmos-predict2-5"
        / "cosmos-predict2-5-2b-720-reason-embedding-ddrl.toml"
    )
    with pytest.raises(ConfigError) as err:
        load_config(shipped)
    said = str(err.value)
    assert "model.rl.train_on" not in said  # (read: policy.diffusers.train_on)
    assert "context_parallel_size" not in said  # (read: policy.parallelism.cp_size)
    assert "checkpoint.load_path" in said and "Cosmos-Predict2.5 network" in said
    assert "model.rl.data_beta" not in said  # (read: DDRL's data_beta)
    assert "dp_replicate_size" not in said  # (read: HSDP's copies)
    translatable = {
        "model": {
            "fsdp_shard_size": 2,
            "dp_replicate_size": 3,
            "rl": {
                "sample_steps": 10,
                "num_rollout": 4,
                "train_on": list(range(8)),
                "data_beta": 0.01,
                "kl_beta": 0.0,
                "guidance": 3.0,
                "max_num_conditional_frames": 0,
                "use_same_seed": False,
            },
        },
        "model_parallel": {"context_parallel_size": 2},
        "optimizer": {"lr": 1e-5, "weight_decay": 1e-4},
        "scheduler": {"warm_up_steps": [50]},
        "trainer": {
            "max_iter": 2001,
            "callbacks": [{"name": "grad_clip", "args": {"clip_norm": 1.0}}],
        },
        "dataloader_train": {"type": "local", "video_dataloader": {"dataset_dir": "/data/clips"}},
        "job": {"project": "p", "group": "g", "name": "n"},
        "policy": {"model_name_or_path": "tiny:cosmos_transformer3d"},
    }
    translated, problems = translate_wfm(translatable)
    assert problems == []
    cfg = config_from_dict(translatable, source="wfm.toml")  # (runs as it is)
    assert cfg == config_from_dict(translated, source="wfm.toml")
    p, d = cfg.train.train_policy, cfg.policy.diffusers
    # its rewards: cosmos-rl's reward service, dance_grpo's overall_reward clipped to [-5, 5]
    assert p.use_remote_reward and len(p.remote_reward.reward_fns) == 1
    [reward] = p.remote_reward.reward_fns
    assert (reward.name, reward.score_key, reward.clip_min, reward.clip_max) == (
        "dance_grpo", "overall_reward", -5.0, 5.0,
    )  # fmt: skip
    assert cfg.policy.is_diffusers and p.trainer_type == "ddrl" and p.data_beta == 0.01
    assert cfg.rollout.n_generation == 4 and d.sample.num_steps == 10
    assert d.train_on == list(range(8)) and d.sample.guidance_scale == 3.0  # (Cosmos's reading)
    assert not d.sample.same_group_noise and p.reference_reset_interval is None  # (kl_beta 0)
    assert (cfg.train.optm_lr, cfg.train.optm_warmup_steps, cfg.train.max_num_steps) == (
        1e-5,
        50,
        2001,
    )
    assert cfg.policy.parallelism.dp_shard_size == 2 and p.dataset.name == "/data/clips"
    assert cfg.policy.parallelism.dp_replicate_size == 3 and cfg.policy.parallelism.cp_size == 2
    assert (d.min_num_conditional_frames, d.max_num_conditional_frames) == (0, 0)
    shipped_rl = tomllib.loads(shipped.read_text())["model"]["rl"]  # (0..1: t2v and i2v mixed)
    translated, _ = translate_wfm({"model": {"rl": shipped_rl}})
    assert translated["policy"]["diffusers"]["min_num_conditional_frames"] == 0
    assert translated["policy"]["diffusers"]["max_num_conditional_frames"] == 1
    assert translated["policy"]["diffusers"]["train_on"] == list(range(0, 20, 2))
    # cosmos-rl's defaults: the group's samples share their start; with a KL, its reference
    # takes the weights every 16 iterations, the optimiser going on
    translated, _ = translate_wfm({"model": {"rl": {"kl_beta": 0.1}}})
    assert translated["policy"]["diffusers"]["sample"]["same_group_noise"] is True
    assert translated["train"]["train_policy"]["reference_reset_interval"] == 16
    assert translated["train"]["train_policy"]["reset_optimizer_with_reference"] is False
    assert (cfg.logging.project_name, cfg.logging.group_name) == ("p", "g")
    rewards = {
        "remote_reward": {"score_key": "vq_reward+ta_reward", "scale": 2.0, "token": "secret"},
        "aesthetic": {"enabled": True},
        "adv_clip_max": 3.0,
    }
    translated, problems = translate_wfm({"model": {"rl": {"reward_config": rewards}}})
    remote = translated["train"]["train_policy"]["remote_reward"]
    assert remote["reward_fns"][0]["score_key"] == "vq_reward+ta_reward"
    assert (remote["scale"], remote["reward_clip_min"], remote["reward_clip_max"]) == (2, -10, 10)
    named = " ".join(problems)
    assert "remote_reward.token = '...'" in named and "REMOTE_REWARD_TOKEN" in named
    assert "secret" not in named
    assert "aesthetic.enabled = True" in named and "adv_clip_min/max = [-5.0, 3.0]" in named
    rewards = {"remote_reward": {"enabled": False}}
    _, problems = translate_wfm({"model": {"rl": {"reward_config": rewards}}})
    assert any("no reward is left" in line for line in problems)
    for guidance, scale in ((0.0, 1.0), (0.5, 1.0)):  # (the pipeline guides only above 1)
        translated, problems = translate_wfm({"model": {"rl": {"guidance": guidance}}})
        assert translated["policy"]["diffusers"]["sample"]["guidance_scale"] == scale
        named = [line for line in problems if line.startswith("model.rl.guidance")]
        assert len(named) == (guidance == 0.5), problems
