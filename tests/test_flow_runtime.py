"""World-model RL in the runtime (`nebula_rl.flow.runtime`): the controller, a policy replica and
rollout replicas as processes (`nebula-rl train` without `--local`), trajectories through the
job's trajectory folder, weights through the weight group; a rollout replica killed mid-run
loses nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flow_configs import tiny_flow_policy, tiny_flow_train_policy
from nebula_rl.config import config_from_dict
from nebula_rl.controller import JobState, connect, start_redis
from nebula_rl.flow.runtime import check_flow_job
from nebula_rl.flow.sampler import Trajectory
from nebula_rl.flow.trajectories import TRAJECTORY_DIR_ENV, TrajectoryStore
from nebula_rl.weights import free_port
from test_chaos import _descendants

CLIPS_PER_PROMPT = 4
NUM_ROWS = 8 * CLIPS_PER_PROMPT  # (the toy dataset's 8 captions)
PROMPTS_PER_STEP = 4


def _job(tmp_path: Path, **changes: object) -> dict:
    """A small async FlowGRPO job (8 x 8 frames, 2 of them, one epoch of the toy dataset) on
    the test's own trajectory folder and controller port, as a config dict."""
    cfg: dict = {
        "train": {
            "output_dir": str(tmp_path / "runs"),
            "timestamp": "wfm",
            "epoch": 1,
            "train_batch_per_replica": PROMPTS_PER_STEP * 4,
            "optm_lr": 1e-3,
            "train_policy": tiny_flow_train_policy(
                mini_batch=8, clips_per_prompt=CLIPS_PER_PROMPT, allowed_outdated_steps=1
            ),
        },
        "rollout": {"n_generation": 4, "batch_size": 2},
        "controller": {"port": free_port(), "heartbeat_timeout": 4.0, "collective_timeout": 30.0},
        "policy": tiny_flow_policy(),
    }
    for key, value in changes.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg


def _start(tmp_path: Path, cfg: dict, *args: str) -> subprocess.Popen[bytes]:
    config = tmp_path / "job.json"
    config.write_text(json.dumps(cfg))
    env = {**os.environ, TRAJECTORY_DIR_ENV: str(tmp_path / "trajectories"), "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config), *args],
        stdout=(tmp_path / "launcher.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def _finish(process: subprocess.Popen[bytes], tmp_path: Path, timeout_s: float = 240) -> Path:
    """Wait for the job; its run folder."""
    run_dir = tmp_path / "runs" / "wfm"
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted(run_dir.glob("logs/*.log"))
    )
    launcher = (tmp_path / "launcher.log").read_text(errors="replace")
    assert process.returncode == 0, f"{launcher[-3000:]}\n{logs}"
    return run_dir


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "policy_version" in r]


def _assert_every_row_trained_once(run_dir: Path) -> None:
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert list(ledger) == ["0"]
    assert ledger["0"]["trained"] == {str(i): 1 for i in range(NUM_ROWS)}
    assert ledger["0"]["summary"]["trained_more_than_once"] == 0


def test_trajectory_store_round_trip_and_cleanup(tmp_path, monkeypatch):
    monkeypatch.setenv(TRAJECTORY_DIR_ENV, str(tmp_path / "shm"))
    store = TrajectoryStore.for_job(tmp_path / "run")
    assert store.root.parent == tmp_path / "shm"
    assert TrajectoryStore.for_job(tmp_path / "run") == store  # every process finds the same
    trajectory = Trajectory(
        latents=torch.randn(4, 5, 3, 2, 8, 8),
        log_probs=torch.randn(4, 4),
        sigmas=torch.linspace(1, 0, 5),
        noise_level=0.7,
    )
    name = store.write("0:17", trajectory)
    again = store.write("0:17", trajectory)  # (a group pushed twice after a crash)
    other = store.write("1:3", trajectory)
    assert len({name, again, other}) == 3
    back = store.read(name)
    assert torch.equal(back.latents, trajectory.latents)
    assert torch.equal(back.log_probs, trajectory.log_probs)
    assert torch.equal(back.sigmas, trajectory.sigmas) and back.noise_level == 0.7
    assert not list(store.root.glob(".*partial"))
    assert store.discard(["0:17"]) == 2
    with pytest.raises(FileNotFoundError, match="is missing"):
        store.read(name)
    assert store.read(other).latents.shape == (4, 5, 3, 2, 8, 8)
    store.remove()
    assert not store.root.exists()


def test_a_world_model_config_survives_the_controllers_round_trip(tmp_path):
    """Replicas read the config from the controller as a full dump (every key, defaults
    included): a world-model config must load from it as it loaded from its file."""
    cfg = config_from_dict(_job(tmp_path), source="job.json")
    again = config_from_dict(cfg.model_dump(mode="json"), source="127.0.0.1:1/api/meta")
    assert again == cfg


def test_what_the_runtime_cannot_run_is_refused_before_it_starts(tmp_path):
    with pytest.raises(ValueError, match="world-model SFT runs in one process"):
        check_flow_job(
            config_from_dict(
                _job(
                    tmp_path,
                    **{
                        "train.train_policy": {
                            "type": "sft",
                            "trainer_type": "diffusers_sft",
                            "dataset": {"name": "builtin:toy_video"},
                        }
                    },
                )
            )
        )
    with pytest.raises(ValueError, match="mini_batch"):
        check_flow_job(config_from_dict(_job(tmp_path, **{"train.train_policy.mini_batch": 6})))
    images = {
        "policy.parallelism.cp_size": 2,
        "policy.model_name_or_path": "tiny:sd3_transformer2d",
    }
    with pytest.raises(ValueError, match="cp_size = 2: context parallelism splits clips by frames"):
        check_flow_job(config_from_dict(_job(tmp_path, **images)))
    latent = {  # (5 frames: 3 latent ones)
        "policy": tiny_flow_policy("tiny:wan_transformer3d_latent", frames=5, size=16),
        "policy.parallelism.cp_size": 2,
    }
    with pytest.raises(ValueError, match=r"cp_size \(2\) must divide the frames of a sample \(3 "):
        check_flow_job(config_from_dict(_job(tmp_path, **latent)))
    latent["policy.parallelism.cp_size"] = 3
    check_flow_job(config_from_dict(_job(tmp_path, **latent)))
    with pytest.raises(ValueError, match=r"cp_size \(4\) must divide the frames of a sample \(2"):
        check_flow_job(config_from_dict(_job(tmp_path, **{"policy.parallelism.cp_size": 4})))
    averaged = {"validation.enable": True, "train.ema_enable": True}
    with pytest.raises(ValueError, match=r"validation\.enable with train\.ema_enable: in the run"):
        check_flow_job(config_from_dict(_job(tmp_path, **averaged)))


@pytest.mark.parametrize(
    ("model", "lora", "shards", "replicate", "cp"),
    [
        ("tiny:dit", None, 1, 1, 1),
        ("tiny:wan_transformer3d", {"r": 4, "target_modules": ["to_q", "to_v"]}, 1, 1, 1),
        pytest.param("tiny:dit", None, 2, 1, 1, marks=pytest.mark.slow),
        pytest.param("tiny:dit", None, 2, 2, 1, marks=pytest.mark.slow),
        pytest.param("tiny:dit", None, 1, 1, 2, marks=pytest.mark.slow),
        pytest.param("tiny:wan_transformer3d", None, 1, 1, 2, marks=pytest.mark.slow),
        pytest.param("tiny:cosmos3_omni_generator", None, 2, 1, 1, marks=pytest.mark.slow),
        pytest.param("tiny:cosmos3_omni_generator", None, 1, 1, 2, marks=pytest.mark.slow),
    ],
    ids=[
        "dit",
        "wan-lora",
        "dit-fsdp2",
        "dit-hsdp",
        "dit-cp2",
        "wan-cp2",
        "cosmos3-fsdp2",
        "cosmos3-cp2",
    ],
)
def test_a_world_model_job_runs_with_rollout_replicas(tmp_path, model, lora, shards, replicate, cp):
    """One policy and one rollout replica, one epoch, with the built-in DiT, with a diffusers
    transformer with a LoRA adapter (the base pushed once, the adapter every step), and (slow)
    with a policy replica of two FSDP2 ranks (each pushing its shards; weight averages
    exported), of four HSDP ranks (two copies of two shards) and of two context-parallel ranks
    (the frames split, the weights sharded over both; the built-in DiT and a Wan transformer),
    and Cosmos 3's generator on two FSDP2 ranks and on two context-parallel ranks: every
    clip trained once, the policy's weights pushed to the rollout each step, the trajectory files gone at the end, a sample
    grid every 4 steps in TensorBoard and `<run>/samples/`, and the export loadable as a flow
    model."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _job(
        tmp_path,
        **{
            "logging.logger": ["console", "tensorboard"],
            "logging.multi_modal_log_interval": 4,
            "policy.model_name_or_path": model,
            "policy.lora": lora,
            "policy.parallelism.dp_shard_size": shards,
            "policy.parallelism.dp_replicate_size": replicate,
            "policy.parallelism.cp_size": cp,
            "train.ema_enable": shards == 2,  # (averages of the shards, exported)
            "train.train_policy.mini_batch": 8 // (shards * replicate),
        },
    )
    if model == "tiny:cosmos3_omni_generator":  # (its Wan VAE takes 1 + 2k frames)
        cfg["policy"]["diffusers"].update(inference_frames=5, train_frames=5)
    run_dir = _finish(_start(tmp_path, cfg), tmp_path)
    _assert_every_row_trained_once(run_dir)
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == list(range(1, NUM_ROWS // PROMPTS_PER_STEP + 1))
    for s in steps:
        assert 0.0 <= s["reward_mean"] <= 1.0 and s["rewards_lost"] == 0.0
        assert s["data_distance"] > 0 and s["staleness_max"] <= 1
    # the rollout sampled with the policy's weights, not only its own starting ones
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "weights of version 3 in place" in rollout_log
    assert not (tmp_path / "trajectories").exists() or not any(
        (tmp_path / "trajectories").iterdir()
    )
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == [
        "step_4.gif", "step_4.png", "step_8.gif", "step_8.png",
    ]  # fmt: skip
    [events] = {p.parent for p in run_dir.rglob("events.out.tfevents*")}
    accumulator = EventAccumulator(str(events), size_guidance={"images": 0})
    accumulator.Reload()
    assert [e.step for e in accumulator.Images("samples")] == [4, 8]
    assert [e.step for e in accumulator.Images("samples_video")] == [4, 8]
    from nebula_rl.flow.models import load_flow_model

    final = run_dir / "safetensors" / "final"
    assert (final / "adapter" / "adapter_model.safetensors").is_file() == (lora is not None)
    exported = config_from_dict(
        {**cfg, "policy": {**cfg["policy"], "model_name_or_path": str(final)}}
    )
    model = load_flow_model(exported)
    assert sum(p.numel() for p in model.parameters()) > 0


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until `pid` is stopped by a signal (state T in /proc)."""
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


@pytest.mark.slow
def test_a_rollout_replica_killed_mid_run_loses_nothing(tmp_path):
    """kill -9 one of two rollout replicas while it holds prompts: its prompts go back to the
    queue, the weight group is rebuilt without it, and the job trains every clip once."""
    with start_redis(data_dir=tmp_path / "redis") as redis_server:
        cfg = _job(tmp_path, redis=redis_server.url)
        process = _start(tmp_path, cfg, "--rollout", "2")
        state = JobState(connect(redis_server.url), "wfm")
        pending = state.key("prompts")
        deadline = time.monotonic() + 180

        def held() -> bool:
            return bool(state.redis.xpending_range(pending, "rollout", "-", "+", 100, "rollout-1"))

        victim = None
        while True:
            assert process.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "rollout-1 never held prompts after step 1"
            if victim is None:
                found = [
                    pid
                    for pid, argv in _descendants(process.pid).items()
                    if "replica" in argv and "--name rollout-1" in argv
                ]
                victim = found[0] if found else None
            if victim is not None and state.step() >= 1 and held():
                # Frozen, it cannot acknowledge what it holds between this check and the kill.
                os.kill(victim, signal.SIGSTOP)
                _wait_stopped(victim)
                if held():
                    break
                os.kill(victim, signal.SIGCONT)
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        run_dir = _finish(process, tmp_path)
    _assert_every_row_trained_once(run_dir)
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["0"]["summary"]["requeue_events"] >= 1
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == list(range(1, NUM_ROWS // PROMPTS_PER_STEP + 1))
    assert (
        "replica rollout-1 missed heartbeats" in (run_dir / "logs" / "controller.log").read_text()
    )


@pytest.mark.slow
def test_a_world_model_job_with_conditioning_frames_runs_with_rollout_replicas(tmp_path):
    """`max_num_conditional_frames = 1`: the rollout replica gives each group the first frame
    of its clip or none, the trajectory files say which, and the policy trains them: every clip
    trained once."""
    cfg = _job(tmp_path, **{"policy.diffusers.max_num_conditional_frames": 1})
    run_dir = _finish(_start(tmp_path, cfg), tmp_path)
    _assert_every_row_trained_once(run_dir)
    for s in _steps(run_dir):
        assert 0.0 <= s["reward_mean"] <= 1.0 and s["rewards_lost"] == 0.0


# (slow: test_runtime resumes a language job through the same controller fast, and
# test_flow_training resumes world-model runs bit-exact fast)
@pytest.mark.slow
def test_a_world_model_job_resumes_from_its_checkpoint(tmp_path):
    """A DiffusionNFT job with weight averages stopped after step 3 (checkpoints at steps 2 and
    3: the model, its old weights, the averages, the optimiser) and run again from step 2
    continues at step 3, and the epoch still trains every clip exactly once."""
    cfg = _job(
        tmp_path,
        **{
            "train.train_policy.trainer_type": "diffusion_nft",
            "policy.diffusers.weight_copy_decay_type": 1,
            "train.ema_enable": True,
            "train.ckpt": {"enable_checkpoint": True, "save_freq": 2},
            "train.max_num_steps": 3,
        },
    )
    run_dir = _finish(_start(tmp_path, cfg), tmp_path)
    assert [s["step"] for s in _steps(run_dir)] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "controller" / "step_2.json").exists()
    cfg["train"]["max_num_steps"] = None
    cfg["train"]["resume"] = str(run_dir / "checkpoints" / "step_2")
    _finish(_start(tmp_path, cfg), tmp_path)
    _assert_every_row_trained_once(run_dir)
    policy_log = (run_dir / "logs" / "policy-0.log").read_text()
    assert "resumed from" in policy_log and "step_2" in policy_log


def test_a_latent_world_model_job_runs_with_rollout_replicas(tmp_path):
    """DDRL with the latent Wan preset (a tiny transformer on a tiny AutoencoderKLWan's
    latents, 5 frames): the rollout decodes its samples for the rewards and the distance to the
    data, the policy encodes the real clips for DDRL's data term, only the transformer's weights
    are pushed, every clip is trained once, and the export is a pipeline folder with its VAE."""
    from nebula_rl.flow.models import load_flow_model
    from nebula_rl.flow.vae import flow_vae

    cfg = _job(
        tmp_path,
        **{
            "policy": tiny_flow_policy("tiny:wan_transformer3d_latent", frames=5),
            "train.train_policy.trainer_type": "ddrl",
            "train.train_policy.data_beta": 0.1,
        },
    )
    run_dir = _finish(_start(tmp_path, cfg), tmp_path)
    _assert_every_row_trained_once(run_dir)
    steps = _steps(run_dir)
    assert len(steps) == NUM_ROWS // PROMPTS_PER_STEP
    for s in steps:
        assert 0.0 <= s["reward_mean"] <= 1.0 and s["rewards_lost"] == 0.0
        assert s["data_distance"] > 0 and torch.isfinite(torch.tensor(s["loss"]))
    assert "weights of version 3 in place" in (run_dir / "logs" / "rollout-0.log").read_text()
    final = run_dir / "safetensors" / "final"
    assert json.loads((final / "model_index.json").read_text())["vae"][1] == "AutoencoderKLWan"
    exported = config_from_dict(
        {**cfg, "policy": {**cfg["policy"], "model_name_or_path": str(final)}}
    )
    assert flow_vae(load_flow_model(exported)) is not None


def test_a_world_model_job_validates_on_its_rollout_replicas(tmp_path):
    """With `validation.enable`, the controller hands the validation clips out as prompts at
    steps 0, 4 and the last; two rollout replicas sample and score them with the weights of
    that step (the policy waits), and each validation's record equals one process's
    validation of those weights: the last one, of the exported model."""
    from nebula_rl.flow.job import flow_clips, flow_scorer, flow_settings
    from nebula_rl.flow.models import load_flow_model
    from nebula_rl.flow.validation import FLOW_VALIDATION_KEYS, validate_generation

    validation = {
        "enable": True,
        "val_before_train": True,
        "freq": 4,
        "n_generation": 2,
        "max_num_prompts": 5,
        "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 1}},
    }
    cfg = _job(tmp_path, validation=validation)
    run_dir = _finish(_start(tmp_path, cfg, "--rollout", "2"), tmp_path)
    _assert_every_row_trained_once(run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    checked = [r for r in map(json.loads, lines) if "val/reward_mean" in r]
    last = NUM_ROWS // PROMPTS_PER_STEP
    assert [r["step"] for r in checked] == [0, 4, last]
    for r in checked:
        assert set(FLOW_VALIDATION_KEYS) <= set(r) and "val/response_length_mean" not in r
        assert r["val/policy_version"] == r["step"] and r["val/rollout_count"] == 5 * 2
    exported = {
        **cfg,
        "policy": {**cfg["policy"], "model_name_or_path": str(run_dir / "safetensors" / "final")},
    }
    config = config_from_dict(exported)
    clips = flow_clips(config, run_dir, create=False, validation=True)
    s = flow_settings(config, num_iterations=1, prompts=PROMPTS_PER_STEP)
    score = flow_scorer(config.train.train_policy)  # type: ignore[arg-type]
    want = validate_generation(load_flow_model(config), clips, s, config, score, step=last)
    assert {k: checked[-1][k] for k in FLOW_VALIDATION_KEYS} == pytest.approx(want, rel=1e-5)
    start = load_flow_model(config_from_dict(cfg), seed=0)  # (the rollouts' starting weights)
    want = validate_generation(start, clips, s, config, score, step=0)
    assert {k: checked[0][k] for k in FLOW_VALIDATION_KEYS} == pytest.approx(want, rel=1e-5)
    assert checked[0]["val/data_distance"] != pytest.approx(checked[-1]["val/data_distance"])


def test_a_world_model_job_trains_on_a_prompt_file_with_rollout_replicas(tmp_path):
    """FlowGRPO on captions alone (a prompt file) with the Wan pipeline's text encoder: the
    rollout replica and the policy each embed the captions, every prompt is trained once, no
    distance to data is reported, and the export carries the text encoder."""
    from flow_configs import tiny_text_pipeline
    from nebula_rl.flow.models import load_flow_model

    pipeline = tiny_text_pipeline(tmp_path / "wan")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"a {c} {s}" for c in ("red", "blue") for s in "abcd") + "\n")
    cfg = _job(
        tmp_path,
        **{
            "policy": tiny_flow_policy(str(pipeline), frames=5, max_prompt_length=16),
            "train.train_policy.dataset": {"name": str(prompts)},
            "train.train_policy.reward_function": "colour_match",
        },
    )
    run_dir = _finish(_start(tmp_path, cfg), tmp_path)
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["0"]["trained"] == {str(i): 1 for i in range(8)}
    steps = _steps(run_dir)
    assert len(steps) == 8 // PROMPTS_PER_STEP
    assert all(s["rewards_lost"] == 0.0 and "data_distance" not in s for s in steps)
    final = run_dir / "safetensors" / "final"
    exported = config_from_dict(
        {**cfg, "policy": {**cfg["policy"], "model_name_or_path": str(final)}}
    )
    assert load_flow_model(exported).text_encoder is not None
