"""The CUDA devices this machine shows, found without torch."""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["visible_gpus"]


def visible_gpus() -> int | None:
    """CUDA devices this machine shows (CUDA_VISIBLE_DEVICES, else nvidia-smi); None if unknown
    or none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()]) or None
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(line.startswith("GPU ") for line in out.splitlines()) or None
