"""The small world-model configs the tests build: `tiny_flow_policy` is the `[policy]` table (a
flow model of `frames` frames of `size` x `size` pixels, sampled in `steps` steps),
`tiny_flow_train_policy` its `[train.train_policy]` table on the toy clips, `tiny_flow_config`
the whole config of such an RL run; `reward_service` starts the reward service such a run is
pointed at by `scored_remotely`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def tiny_flow_policy(
    model: str = "tiny:dit", *, frames: int = 2, size: int = 8, steps: int = 4, **diffusers: Any
) -> dict[str, Any]:
    """`policy` of a world-model config: `model_name_or_path = model`, `is_diffusers`, and
    `[policy.diffusers]` with the given shape and sampler steps (and `diffusers`' extra keys)."""
    return {
        "model_name_or_path": model,
        "is_diffusers": True,
        "diffusers": {
            "is_video": frames > 1,
            "inference_size": [size, size],
            "inference_frames": frames,
            "train_frames": frames,
            "sample": {"num_steps": steps, "eval_num_steps": steps},
            **diffusers,
        },
    }


def tiny_flow_config(
    output_dir: Any,
    policy: dict[str, Any],
    *,
    trainer: str = "flow_grpo",
    max_num_steps: int = 3,
    clip: float = 1e-3,
    timestamp: str | None = None,
    **train_policy: Any,
) -> dict[str, Any]:
    """A world-model RL config (as a dict) of `policy` on the toy clips (two per prompt, scored
    by brightness, 4 samples per prompt, 8 per step in passes of 4), with `trainer`'s loss
    clipped at `clip` on both sides, and `train_policy`'s extra keys."""
    train: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_num_steps": max_num_steps,
        "train_batch_per_replica": 8,
        "optm_lr": 1e-3,
        "train_policy": tiny_flow_train_policy(trainer, clip=clip, **train_policy),
    }
    if timestamp is not None:
        train["timestamp"] = timestamp
    return {"train": train, "rollout": {"n_generation": 4}, "policy": policy}


def tiny_flow_train_policy(
    trainer: str = "flow_grpo",
    *,
    clip: float = 1e-3,
    mini_batch: int = 4,
    clips_per_prompt: int = 2,
    **extra: Any,
) -> dict[str, Any]:
    """`train.train_policy` of a world-model RL config: `trainer` on the toy clips
    (`clips_per_prompt` per prompt) scored by brightness, its loss clipped at `clip` on both
    sides, passes of `mini_batch` rows, and `extra` keys."""
    return {
        "type": "grpo",
        "trainer_type": trainer,
        "reward_function": "brightness",
        "mini_batch": mini_batch,
        "epsilon_low": clip,
        "epsilon_high": clip,
        "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": clips_per_prompt}},
        **extra,
    }


@contextmanager
def reward_service(monkeypatch: Any, reward_type: str) -> Iterator[Any]:
    """The reward service scoring with `reward_type`, started here on a free port, and the
    `REMOTE_REWARD_*` variables a world-model run reads set to reach it (token included)."""
    from nebula_rl.rewards.service import service_config_from_dict, start_service
    from nebula_rl.weights import free_port

    config = service_config_from_dict(
        {"port": free_port(), "reward_args": [{"reward_type": reward_type}]}
    )
    with start_service(config, token="secret-token") as service:
        base = f"{service.url}/api/reward"
        monkeypatch.setenv("REMOTE_REWARD_TOKEN", "secret-token")
        monkeypatch.setenv("REMOTE_REWARD_ENQUEUE_URL", f"{base}/enqueue")
        monkeypatch.setenv("REMOTE_REWARD_FETCH_URL", f"{base}/pull")
        yield service


def scored_remotely(cfg: dict[str, Any], name: str, *, weight: float, batch_size: int) -> None:
    """Make the world-model config `cfg` (a dict, changed in place) score through the reward
    service with the function `name` at `weight`, in requests of `batch_size` samples."""
    policy = cfg["train"]["train_policy"]
    policy["use_remote_reward"] = True
    del policy["reward_function"]
    policy["remote_reward"] = {
        "batch_size": batch_size,
        "reward_fns": [{"name": name, "weight": weight}],
    }
