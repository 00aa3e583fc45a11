"""Rewards for the reward-service tests that the service's spawned workers import as
`reward_helpers:probe`, `reward_helpers:video_align`, `reward_helpers:text_parts` and
`reward_helpers:gated_length` (they get pytest's sys.path, which holds tests/). `video_align` and
`text_parts` answer several scores per sample, under their names.

`probe` is `brightness` with behaviour a prompt asks for: `sleep=S` sleeps S seconds (the
longest asked in the batch) before scoring, `fail` raises, `nan` scores that sample NaN. Each
call appends its batch size to the file $NEBULA_TEST_REWARD_RECORD when that is set (read when
the worker starts), so a test sees how the service batched requests. A worker process started
while $NEBULA_TEST_WORKER_CRASH is set dies importing this module (exit code 3). `gated_length`
is a text reward that scores only once a file the test creates exists.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from collections.abc import Sequence

from torch import Tensor

from nebula_rl.rewards.visual import brightness, colour_match

RECORD_ENV = "NEBULA_TEST_REWARD_RECORD"
"""File each `probe` call appends its batch size to (a line each)."""
CRASH_ENV = "NEBULA_TEST_WORKER_CRASH"
"""Set: a worker process (not the test process) dies importing this module."""

if os.environ.get(CRASH_ENV) and multiprocessing.parent_process() is not None:
    os._exit(3)


def probe(pixels: Tensor, prompts: Sequence[str]) -> list[float]:
    """`brightness`, after the sleep, failure or NaN the prompts ask for."""
    record = os.environ.get(RECORD_ENV)
    if record:
        with open(record, "a") as f:
            f.write(f"{len(prompts)}\n")
    seconds = [float(s) for p in prompts for s in re.findall(r"sleep=([0-9.]+)", p)]
    time.sleep(max(seconds, default=0.0))
    if any("fail" in p for p in prompts):
        raise ValueError("a prompt asked this reward to fail")
    scores = brightness(pixels, prompts)
    return [float("nan") if "nan" in p else s for p, s in zip(prompts, scores, strict=True)]


def video_align(pixels: Tensor, prompts: Sequence[str]) -> dict[str, list[float]]:
    """Several scores of each sample, as cosmos-rl's `dance_grpo` (VideoAlign) answers: the
    brightness as `vq_reward`, the colour match as `ta_reward`, their sum as `overall_reward`."""
    quality, alignment = brightness(pixels, prompts), colour_match(pixels, prompts)
    return {
        "overall_reward": [q + a for q, a in zip(quality, alignment, strict=True)],
        "vq_reward": quality,
        "ta_reward": alignment,
    }


def text_parts(completion: str, reference: str) -> dict[str, float]:
    """A text reward of several scores: `exact` (1 when the stripped completion is the
    reference), `chars` (its length over 10)."""
    return {"exact": float(completion.strip() == reference), "chars": len(completion) / 10}


def text_length(completion: str, reference: str) -> float:
    """The completion's length in characters over 10: a reward that varies within a group even
    for an untrained model (tests/test_colocated.py compares two runs' losses with it)."""
    return len(completion) / 10


GATE_ENV = "NEBULA_TEST_REWARD_GATE"
"""A file `gated_length` waits for before it scores (read when it is called)."""


def gated_length(completion: str, reference: str) -> float:
    """A text reward: the completion's length in characters, once the file $NEBULA_TEST_REWARD_GATE
    exists (so a test decides when scores can arrive; raises after 60 s without it)."""
    gate = os.environ.get(GATE_ENV)
    deadline = time.monotonic() + 60
    while gate and not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} was never created")
        time.sleep(0.01)
    return float(len(completion))
