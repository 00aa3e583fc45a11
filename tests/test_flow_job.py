"""World-model runs from their configs (`policy.is_diffusers`, `nebula_rl.flow.job`): the shipped
`configs/wfm/` load, keys a world-model run does not read are refused by name, and SFT, FlowGRPO,
DDRL and DiffusionNFT (scored by the reward service) run from TOML-shaped configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flow_configs import reward_service, scored_remotely, tiny_flow_config, tiny_flow_policy
from nebula_rl.config import ConfigError, config_from_dict, load_config
from nebula_rl.flow.data import clip_batch
from nebula_rl.flow.diffusers_models import DIFFUSERS_PRESETS
from nebula_rl.flow.job import flow_clips
from nebula_rl.flow.models import check_flow_model, flow_model_config, load_flow_model

ROOT = Path(__file__).resolve().parents[1]
WFM = sorted((ROOT / "configs" / "wfm").glob("*.toml"))


def _flow(tmp_path: Path, *, trainer: str = "flow_grpo", **policy: object) -> dict:
    """A small world-model RL config (8 x 8 frames, 2 of them, 16 toy clips) as a dict."""
    sample = {"num_steps": 4, "eval_num_steps": 4, "guidance_scale": 1.0}
    return tiny_flow_config(
        tmp_path,
        tiny_flow_policy("tiny:dit", train_flow_shift=1.0, sample=sample),
        trainer=trainer,
        max_num_steps=2,
        clip=1e-4,
        **policy,
    )


@pytest.mark.parametrize("path", WFM, ids=lambda p: p.name)
def test_the_shipped_world_model_configs_load(path, tmp_path):
    """Each loads; the warm start builds the model the RL configs start from; the GPU demo's
    model, as bench/gpu/make_cosmos.py writes it (here two blocks narrow), is one the config
    can train."""
    cfg = load_config(path)
    assert cfg.policy.is_diffusers
    if cfg.policy.model_name_or_path in DIFFUSERS_PRESETS:
        check_flow_model(cfg)
    elif cfg.policy.model_name_or_path == "/tmp/nebula-gpu/cosmos2b":
        folder = tmp_path / "cosmos"
        small = ["--layers", "2", "--heads", "2", "--head-dim", "32"]
        script = [sys.executable, str(ROOT / "bench" / "gpu" / "make_cosmos.py")]
        subprocess.run([*script, "--out", str(folder), *small], check=True, capture_output=True)
        moved = cfg.policy.model_copy(update={"model_name_or_path": str(folder)})
        cfg = cfg.model_copy(update={"policy": moved})
        check_flow_model(cfg)
        x, text, mask = clip_batch(flow_clips(cfg, tmp_path / "run")[:2])
        velocity = load_flow_model(cfg, seed=0)(x, torch.full((2,), 0.5), text, mask)
        assert velocity.shape == x.shape == (2, 3, 2, 32, 32)
    elif cfg.policy.warmstart_config is None:
        assert flow_model_config(cfg.policy).size == 16
    else:
        warm = load_config(ROOT / cfg.policy.warmstart_config)
        out = Path(warm.train.output_dir) / warm.train.timestamp / "safetensors" / "final"
        assert out == Path(cfg.policy.model_name_or_path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"rollout": {"max_response_length": 5}},
            r"rollout\.max_response_length = 5: does not apply to world-model runs",
        ),
        (
            {"train": {"compile": True}},
            r"train\.compile = true: does not apply",
        ),
        (
            {"train": {"train_policy": {"trainer_type": "ddrl"}}},
            r"data_beta = 0\.0: world-model DDRL",
        ),
        ({"train": {"train_policy": {"data_beta": 0.1}}}, r"data_beta = 0\.1: world-model DDRL"),
        (
            {"policy": {"diffusers": {"sample": {"deterministic_sampling": True}}}},
            r"deterministic_sampling = true: world-model FlowGRPO and DDRL need",
        ),
        (
            {"rollout": {"n_generation": 1}},
            r"rollout\.n_generation = 1: world-model RL's advantages are group-relative",
        ),
        (
            {"policy": {"diffusers": {"weight_copy_decay_type": 3}}},
            r"weight_copy_decay_type",
        ),
        (
            {"train": {"train_policy": {"trainer_type": "grpo"}}},
            r'trainer_type = "grpo": world-model RL trains with',
        ),
        (
            {"policy": {"diffusers": {"sample": {"solver": "dpm2"}}}},
            r'solver = "dpm2" solves the ODE',
        ),
        (
            {"policy": {"diffusers": {"sample": {"solver": "ddim"}}}},
            r'solver = "ddim": world-model',
        ),
        (
            {"train": {"train_policy": {"use_remote_reward": True}}},
            r"reward_function: a world-model run with use_remote_reward",
        ),
        (
            {"policy": {"diffusers": {"train_on": [0, 4]}}},
            r"train_on = \[0, 4\]: each entry is -1 or a distinct step index below "
            r"policy\.diffusers\.sample\.num_steps \(4\)",
        ),
        (
            {"policy": {"diffusers": {"train_on": [1, 1]}}},
            r"train_on = \[1, 1\]: each entry is -1 or a distinct",
        ),
        (
            {"policy": {"diffusers": {"train_on": [0, -1, -1, -1, -1]}}},
            r"train_on = \[0, -1, -1, -1, -1\]: more steps than a rollout has",
        ),
        (
            {"policy": {"diffusers": {"train_on": [0], "timesteps_fraction": 0.5}}},
            r"timesteps_fraction = 0\.5 picks the steps too",
        ),
        (
            {"train": {"train_policy": {"reference_reset_interval": 2}}},
            r"reference_reset_interval = 2: resets the KL reference, which a world-model run has "
            r"only with kl_beta > 0",
        ),
    ],
)
def test_world_model_configs_refuse_what_the_run_does_not_read(tmp_path, change, match):
    data = _flow(tmp_path)
    for section, values in change.items():
        table = data[section]
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(table.get(key), dict):
                table[key] = _merge(table[key], value)
            else:
                table[key] = value
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


def _merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def test_language_model_configs_refuse_world_model_keys():
    with pytest.raises(ConfigError, match=r"inference_frames = 3: applies to world-model runs"):
        config_from_dict({"policy": {"diffusers": {"inference_frames": 3}}})
    with pytest.raises(ConfigError, match=r'trainer_type = "ddrl": needs policy\.is_diffusers'):
        config_from_dict({"train": {"train_policy": {"type": "grpo", "trainer_type": "ddrl"}}})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_then_flow_grpo_and_ddrl_run_from_their_configs(tmp_path):
    """World-model SFT exports a model that FlowGRPO and DDRL then start from; each writes its
    metrics, an export loadable as `policy.model_name_or_path` and a sample grid; an export
    of another shape is refused naming the keys."""
    from nebula_rl.flow import job

    sft = _flow(tmp_path)
    sft["train"]["train_policy"] = {
        "type": "sft",
        "trainer_type": "diffusers_sft",
        "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 2}},
    }
    sft["train"].update(timestamp="sft", max_num_steps=20, epoch=20)
    sft["policy"]["diffusers"]["weighting_scheme"] = "logit_normal"
    run = job.run(config_from_dict(sft))
    losses = [r["loss"] for r in _records(run)]
    assert len(losses) == 20 and sum(losses[-5:]) < sum(losses[:5])
    export = run / "safetensors" / "final"
    assert (run / "samples.png").is_file()

    for trainer, extra in (
        ("flow_grpo", {"kl_beta": 0.01}),
        ("ddrl", {"data_beta": 0.1, "exp_reward": True}),
    ):
        data = _flow(tmp_path, trainer=trainer, **extra)
        data["train"]["timestamp"] = trainer
        data["policy"]["model_name_or_path"] = str(export)
        cfg = config_from_dict(data)
        warm = load_flow_model(cfg)
        records = _records(job.run(cfg))
        assert [r["iteration"] for r in records] == [1.0, 2.0]
        assert all(r["rewards_lost"] == 0 and 0 < r["reward_mean"] < 1 for r in records)
        trained = load_flow_model(
            config_from_dict(
                {
                    **data,
                    "policy": {
                        **data["policy"],
                        "model_name_or_path": str(tmp_path / trainer / "safetensors" / "final"),
                    },
                }
            )
        )
        assert any(
            not torch.equal(a, b)
            for a, b in zip(warm.state_dict().values(), trained.state_dict().values(), strict=True)
        )
    other = _flow(tmp_path)
    other["policy"]["model_name_or_path"] = str(export)
    other["policy"]["diffusers"]["inference_size"] = [16, 16]
    with pytest.raises(ValueError, match=r"the config asks for 2 of 16 \(policy\.diffusers"):
        load_flow_model(config_from_dict(other))


def test_diffusion_nft_scored_by_the_reward_service(tmp_path, monkeypatch):
    """DiffusionNFT with `use_remote_reward`: the reward service (started here) scores every
    iteration's samples, in requests of `remote_reward.batch_size`."""
    from nebula_rl.flow import job

    with reward_service(monkeypatch, "colour_match") as service:
        data = _flow(tmp_path, trainer="diffusion_nft")
        scored_remotely(data, "colour_match", weight=2.0, batch_size=4)
        data["policy"]["diffusers"].update(weight_copy_decay_type=1)
        data["policy"]["diffusers"]["sample"]["deterministic_sampling"] = True
        records = _records(job.run(config_from_dict(data)))
        calls = service.service.stats()
    assert [r["rewards_lost"] for r in records] == [0.0, 0.0]
    assert all(-2 <= r["reward_mean"] <= 2 for r in records)
    assert "colour_match" in json.dumps(calls)


def test_a_reward_of_several_scores_counts_its_score_key(tmp_path, monkeypatch):
    """`remote_reward.reward_fns[].score_key` picks one of the scores a reward answers (as
    cosmos-rl's configs take `overall_reward` of `dance_grpo`): a run scored by the `vq_reward`
    of a reward that answers brightness under that key sees the rewards of a run scored by
    `brightness` in process (the same samples: the same seed), within the service's uint8
    pixels."""
    from nebula_rl.flow import job

    local = _flow(tmp_path / "local")
    local["train"]["train_policy"]["reward_function"] = "brightness"
    want = _records(job.run(config_from_dict(local)))
    with reward_service(monkeypatch, "reward_helpers:video_align"):
        data = _flow(tmp_path / "remote")
        scored_remotely(data, "reward_helpers:video_align", weight=1.0, batch_size=4)
        data["train"]["train_policy"]["remote_reward"]["reward_fns"][0]["score_key"] = "vq_reward"
        got = _records(job.run(config_from_dict(data)))
    assert got[0]["rewards_lost"] == 0.0
    assert got[0]["reward_mean"] == pytest.approx(want[0]["reward_mean"], abs=1e-2)


def test_what_the_runtime_cannot_run_is_refused_before_anything_starts(tmp_path):
    """`nebula-rl train` without `--local` runs world-model RL with replicas
    (`tests/test_flow_runtime.py`); a config they cannot run is refused by name (exit 2) before
    a process starts: here a `mini_batch` that does not divide a step's samples."""
    raw = _flow(tmp_path, mini_batch=3)
    config = tmp_path / "job.json"
    config.write_text(config_from_dict(raw).model_dump_json())
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2
    said = " ".join((result.stdout + result.stderr).split())  # (rich wraps the log line)
    assert "train.train_policy.mini_batch (3) must divide the samples of a step" in said
    assert not list(tmp_path.glob("*/logs/controller.log"))


def test_world_model_runs_log_scalars_and_sample_grids(tmp_path):
    """`logging.logger` sinks get every step's numbers, and `multi_modal_log_interval` a sample
    grid every that many steps: TensorBoard images, and PNGs under `<run>/samples/`; the
    clips' animations beside them as GIFs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nebula_rl.flow import job

    data = _flow(tmp_path)
    data["train"]["max_num_steps"] = 4
    data["logging"] = {"logger": ["console", "tensorboard"], "multi_modal_log_interval": 2}
    run = job.run(config_from_dict(data))
    assert sorted(p.name for p in (run / "samples").iterdir()) == [
        "step_2.gif", "step_2.png", "step_4.gif", "step_4.png",
    ]  # fmt: skip
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("samples")] == [2, 4]
    assert [e.step for e in events.Images("samples_video")] == [2, 4]  # (2 frames: animated)
    assert events.Images("samples_video")[0].encoded_image_string.startswith(b"GIF89a")
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]
    grid = events.Images("samples")[0]
    assert (grid.height, grid.width) == (8 * 8, 4 * 2 * 8)  # 8 captions x 4 samples of 2 frames
    with pytest.raises(ConfigError, match=r"multi_modal_log_interval = 2: image and video"):
        config_from_dict({"logging": {"multi_modal_log_interval": 2}})
