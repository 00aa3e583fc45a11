"""Helpers for tests that run `nebula-rl train` SFT jobs as processes and compare two of them."""

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

CLI = [sys.executable, "-m", "nebula_rl.cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def train(config: Path, launcher: Sequence[str] = tuple(CLI)) -> None:
    """`nebula-rl train --config config` (started by `launcher`), one torch thread per process;
    fails the test with the job's output when it does not succeed."""
    result = subprocess.run(
        [*launcher, "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def assert_two_like_one(
    run_root: Path, num_steps: int, *, atol: float, folder: str = "final"
) -> dict[str, torch.Tensor]:
    """The runs `run_root/one` and `run_root/two` took the same `num_steps` steps: the same global
    token counts, losses and gradient norms to 1e-5 and exported weights (`safetensors/<folder>`)
    to rtol 1e-4 and `atol`; the weights."""
    runs = {
        name: [json.loads(line) for line in (run_root / name / "metrics.jsonl").open()]
        for name in ("one", "two")
    }
    assert [m["step"] for m in runs["two"]] == list(range(1, num_steps + 1))
    for one, two in zip(runs["one"], runs["two"], strict=True):
        assert two["num_tokens"] == one["num_tokens"]  # the global count, not one rank's
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    weights = {
        name: load_file(run_root / name / "safetensors" / folder / "model.safetensors")
        for name in ("one", "two")
    }
    assert weights["one"].keys() == weights["two"].keys()
    for key, want in weights["one"].items():
        torch.testing.assert_close(weights["two"][key], want, rtol=1e-4, atol=atol)
    return weights["one"]
