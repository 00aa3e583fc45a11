"""The pieces every config section is built from: the base model, the error type, the
`refused` marker and the reasons several refused keys share.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the dotted key."""


def refused(reason: str) -> Any:
    """Field metadata: the feature behind this key is not built yet; any value but the default
    is refused with `reason` (see :func:`refusals`)."""
    return {"refused": reason}


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


# Reasons shared by several keys.
NEEDS_CUDA = "needs CUDA and is not supported yet"
WORLD_LORA = (
    "a world model's LoRA is read from policy.lora (cosmos-rl's policy.diffusers.lora is not)"
)
NO_WORLD = "world-model (diffusers) training is not supported yet"
NO_VLA = "vision-language-action (robot policy) training is not supported yet"
NO_LOAD_BALANCE = "load-balanced SFT batching is not supported yet"
NO_UPLOAD = (
    "uploading to the Hugging Face Hub is not supported yet; push `safetensors/` with "
    "huggingface_hub's `hf upload`"
)


Dtype = Literal["float32", "bfloat16", "float16"]
"""A floating-point dtype by name."""

RewardSpec = str | list[str] | dict[str, float]


def reward_weights(value: RewardSpec) -> dict[str, float]:
    """cosmos-rl's forms: a name, a list of names (weight 1 each), or a table of name = weight."""
    if isinstance(value, str):
        return {value: 1.0}
    if isinstance(value, list):
        return dict.fromkeys(value, 1.0)
    return value
