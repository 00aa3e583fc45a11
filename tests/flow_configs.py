"""The small world-model configs the tests build: `tiny_flow_policy` is the `[policy]` table (a
flow model of `frames` frames of `size` x `size` pixels, sampled in `steps` steps),
`tiny_flow_train_policy` its `[train.train_policy]` table on the toy clips, `tiny_flow_config`
the whole config of such an RL run."""

from __future__ import annotations

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
