"""Hugging Face Hub names, without importing the Hub client's heavy users (the controller and
`nebula-rl check` use this)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["is_hub_id"]


def is_hub_id(name: str) -> bool:
    """Whether `name` is a well-formed Hub repo id `owner/name` that is not an existing local path.

    A bare `name` without an owner is refused although the Hub still redirects some legacy ones
    (`gpt2`): a mistyped local folder name would otherwise turn into a download attempt.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1 or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True
