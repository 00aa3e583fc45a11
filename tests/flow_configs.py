"""The `[policy]` table of the small world-model configs the tests build: a flow model of
`frames` frames of `size` x `size` pixels, sampled in `steps` steps."""

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
