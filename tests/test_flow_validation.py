"""World-model validation (`[validation]` of a world-model run, `nebula_rl.flow.validation`): a
sample's draws are its own, so a validation does not depend on how its clips are batched or
split; a run validates at the steps `validation_due` names, and its numbers are those of the
weights it validated (the exported ones, in one process, sharded or not)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flow_configs import tiny_flow_config, tiny_flow_policy
from nebula_rl.config import ConfigError, config_from_dict, load_config
from nebula_rl.flow import job
from nebula_rl.flow.job import flow_clips, flow_scorer, flow_settings
from nebula_rl.flow.models import load_flow_model
from nebula_rl.flow.validation import (
    FLOW_VALIDATION_KEYS,
    validate_generation,
    validate_loss,
    validation_loss,
    validation_samples,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_flow_parallel import COLOCATED_SFT, _job, _train_cli

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = {
    "enable": True,
    "val_before_train": True,
    "freq": 2,
    "n_generation": 2,
    "batch_size": 2,
    "max_num_prompts": 3,
    "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 1}},
}


def _config(tmp_path: Path, **changes: object) -> dict:
    """A small FlowGRPO config (3 steps) validating 3 clips x 2 samples, with `changes`."""
    sample = {"num_steps": 4, "eval_num_steps": 3, "guidance_scale": 1.0}
    data = tiny_flow_config(
        tmp_path, tiny_flow_policy("tiny:dit", train_flow_shift=1.0, sample=sample),
        max_num_steps=3, timestamp="run",
    )  # fmt: skip
    data["validation"] = dict(VALIDATION)
    data.update(changes)
    return data


def _exported(data: dict, run_dir: Path) -> torch.nn.Module:
    """The model a run exported, loaded in this process."""
    moved = {**data["policy"], "model_name_or_path": str(run_dir / "safetensors" / "final")}
    return load_flow_model(config_from_dict({**data, "policy": moved}))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """The tiny DiT's output layer starts at 0 (every velocity 0): give it weights."""
    with torch.no_grad():
        model.out.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(2))  # type: ignore[union-attr]
    return model


def test_a_validation_sample_does_not_depend_on_its_batch(tmp_path):
    """Each sample's noise (and count of given frames) comes from its seed: sampled in one
    batch, or one at a time, the samples are the same; SFT's per-clip losses likewise."""
    data = _config(tmp_path)
    data["policy"]["diffusers"].update(max_num_conditional_frames=1)
    cfg = config_from_dict(data)
    model = _perturbed(load_flow_model(cfg, seed=0))
    clips = flow_clips(cfg, tmp_path / "run")[:3]
    s = flow_settings(cfg, num_iterations=1, prompts=2)
    seeds = [11, 12, 13]
    together = validation_samples(model, clips, seeds, s, num_steps=3)
    apart = [
        validation_samples(model, [c], [k], s, num_steps=3)
        for c, k in zip(clips, seeds, strict=True)
    ]
    torch.testing.assert_close(together, torch.cat(apart), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(together[0], together[1])  # (other noise, other captions)
    again = validation_samples(model, clips[:1], [12], s, num_steps=3)
    assert not torch.allclose(again, together[:1])  # (the seed draws the noise)
    losses = validation_loss(model, clips, seeds, conditional_frames=(0, 1))
    one = [
        validation_loss(model, [c], [k], conditional_frames=(0, 1))[0]
        for c, k in zip(clips, seeds, strict=True)
    ]
    assert losses == pytest.approx(one, rel=1e-5)


def test_a_local_run_validates_the_weights_of_the_due_steps(tmp_path):
    """With `val_before_train` and `freq = 2`, a 3-step run validates steps 0, 2 and 3 (the
    last); step 0 is a record of its own. The last validation is that of the exported weights
    (with `ema_enable`: the averages, as cosmos-rl validates), scored by the validation rewards,
    recomputed here in one call; the data distance is the samples' to the validation clips."""
    data = _config(tmp_path)
    data["train"].update(ema_enable=True, ema_decay=0.5)
    data["validation"]["reward_function"] = "colour_match"
    cfg = config_from_dict(data)
    run_dir = job.run(cfg)
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert set(records[0]) == {"step", *FLOW_VALIDATION_KEYS}
    assert not any(k.startswith("val/") for k in records[1])
    assert all(set(FLOW_VALIDATION_KEYS) <= set(records[i]) for i in (2, 3))
    assert [records[i]["val/policy_version"] for i in (0, 2, 3)] == [0, 2, 3]
    assert records[3]["val/rollout_count"] == 3 * 2
    val_clips = flow_clips(cfg, run_dir, create=False, validation=True)
    assert len(val_clips) == 3 and (run_dir / "val_dataset").is_dir()
    train_clips = flow_clips(cfg, run_dir, create=False)
    assert not torch.equal(val_clips[0].video, train_clips[0].video)  # (another seed)
    model = _exported(data, run_dir)
    score = job.flow_validation_scorer(cfg.validation, flow_scorer(cfg.train.train_policy))  # type: ignore[arg-type]
    s = flow_settings(cfg, num_iterations=1, prompts=2)
    again = validate_generation(model, val_clips, s, cfg, score, step=3)
    assert again == pytest.approx({k: records[3][k] for k in FLOW_VALIDATION_KEYS}, rel=1e-5)
    # (another reward gives other numbers: the validation's rewards were used)
    other = validate_generation(
        model, val_clips, s, cfg, flow_scorer(cfg.train.train_policy), step=3
    )  # type: ignore[arg-type]
    assert other["val/reward_mean"] != pytest.approx(again["val/reward_mean"], rel=1e-3)


@pytest.mark.parametrize("trainer", ["flow_grpo", "flow_grpo-uncentralized", "diffusers_sft"])
def test_sharded_runs_validate_like_one_process(tmp_path, trainer):
    """Colocated RL and SFT on 2 FSDP2 ranks validate the exported weights: the last step's
    numbers equal one process's validation of the exported model. A colocated replica's ranks
    sample the validation clips with their copies of the weights; uncentralized RL and SFT, in
    the job's own ranks, split the 3 clips 2 + 1 over the sharded model (the short share
    padded, its repeat dropped)."""
    # (one clip per forward: without the padding, rank 1 would run one forward less and hang)
    changes: dict[str, object] = {"validation": {**VALIDATION, "batch_size": 1}}
    if trainer == "flow_grpo-uncentralized":
        trainer = "flow_grpo"
        changes["train.train_policy.uncentralized_training"] = True
    if trainer == "diffusers_sft":
        changes |= COLOCATED_SFT
    config = _job(tmp_path, **changes)
    result = _train_cli(config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "colocated"
    records: dict[int, dict] = {}  # (a colocated replica's job records validation apart)
    for record in _records(run_dir):
        records.setdefault(record["step"], {}).update(record)
    assert list(records) == [0, 1, 2, 3]
    data = json.loads(config.read_text())
    data["policy"]["parallelism"] = {"dp_shard_size": 1}
    data["rollout"].pop("parallelism", None)
    data.pop("mode")
    data["train"]["train_policy"].pop("uncentralized_training", None)
    cfg = config_from_dict(data)
    val_clips = flow_clips(cfg, run_dir, create=False, validation=True)
    model = _exported(data, run_dir)
    if trainer == "diffusers_sft":
        want = validate_loss(model, val_clips, cfg)
        assert records[0]["val_loss"] != pytest.approx(want["val_loss"], rel=1e-4)  # (trained)
        assert records[3]["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
        return
    score = flow_scorer(cfg.train.train_policy)  # type: ignore[arg-type]
    s = flow_settings(cfg, num_iterations=1, prompts=2)
    want = validate_generation(model, val_clips, s, cfg, score, step=3)
    assert want["val/rollout_count"] == 6
    assert {k: records[3][k] for k in FLOW_VALIDATION_KEYS} == pytest.approx(want, rel=1e-5)


def test_world_model_validation_keys(tmp_path):
    """The validation keys a world model reads are accepted (cosmos-rl's prompt-file
    `local_dir` among them: `flow.prompts`); the others are refused by name."""
    config_from_dict(_config(tmp_path))
    for key, value, match in (
        ("subset", "hard", r"validation\.dataset\.subset = \"hard\": does not apply"),
    ):
        data = _config(tmp_path)
        data["validation"]["dataset"] = {**VALIDATION["dataset"], key: value}  # type: ignore[dict-item]
        with pytest.raises(ConfigError, match=match):
            config_from_dict(data)
    data = _config(tmp_path)
    data["validation"]["temperature"] = 0.5
    with pytest.raises(ConfigError, match=r"validation\.temperature = 0\.5: does not apply"):
        config_from_dict(data)
    cosmos = ROOT / "tests" / "data" / "cosmos-rl" / "configs" / "sana" / "sana-video-sft.toml"
    loaded = load_config(cosmos)  # (its validation keys, offload among its others)
    assert loaded.validation.enable and loaded.validation.dataset.local_dir == "local_dir"
    assert loaded.policy.diffusers.offload
