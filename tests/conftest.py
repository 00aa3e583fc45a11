"""Shared test settings: one torch thread per process (2-core machines), quiet transformers;
`grpo_job_config`, the small arithmetic GRPO job the runtime, chaos and panel tests run; and
`redis_server`, a private Redis per test; `vlm_demo_sft`, built once per run, also when
pytest-xdist spreads the run over processes."""

import copy
import multiprocessing
import multiprocessing.context
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
import transformers
from filelock import FileLock

from nebula_rl.config import Config, config_from_dict
from nebula_rl.controller import RedisServer, start_redis

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()


RANK_PRELOAD = ["torch", "torch.distributed", "transformers.modeling_utils", "nebula_rl.models"]


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context tests start their ranks and group members from: a forkserver
    that imported torch and transformers' modelling code once for the pytest process, where
    'spawn' pays those imports (~5 s of CPU) in every process. Its processes get the test
    process's environment as it was at the first use."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files with a test marked `early` first (in their order), then the others: pytest-xdist
    (`--dist loadfile --no-loadscope-reorder`, as .ci/run runs the slow suite) hands files out
    in this order, so the longest start at once instead of one of them running alone at the
    end (the VLM demo tests, ~10 min together, came last)."""
    early = {item.path for item in items if item.get_closest_marker("early")}
    items.sort(key=lambda item: item.path not in early)  # (stable: the order within stays)


def solo_threads() -> int:
    """torch threads for a test's single process: two when the test run has the machine to
    itself, one beside another pytest worker (pytest-xdist). Two threads on a core the other
    worker's jobs keep busy wait on each other at every parallel op: under `-n 2` the VLM SFT
    warm start took 830 s so (242 s alone; 301-385 s on one thread), and the VLM GRPO demo test
    662 s (~300 s alone; 379 s on one thread)."""
    return 1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2


def least_squares_slope(values: list[float]) -> float:
    """The least-squares slope of `values` against their index: how a learning test reads a
    trend from every step's reward, not from two windows of a few noisy steps."""
    n = len(values)
    mean_t, mean_v = (n - 1) / 2, sum(values) / n
    num = sum((t - mean_t) * (v - mean_v) for t, v in enumerate(values))
    return num / sum((t - mean_t) ** 2 for t in range(n))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """The test's own Redis (password, loopback, data in the test's folder), stopped after."""
    with start_redis(data_dir=tmp_path / "redis") as server:
        yield server


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` merged in, table by table (a value that is not a table replaces; None
    removes the key, as TOML cannot say None)."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def arithmetic_grpo_config(
    tmp_path: Path,
    *changes: dict[str, Any],
    timestamp: str = "run",
    num_rows: int = 24,
    groups: int = 4,
    n_generation: int = 4,
    allowed: int = 1,
) -> Config:
    """A GRPO job on the built-in arithmetic task (`num_rows` rows) with the tiny Qwen2 preset
    on CPU: `groups` prompts of `n_generation` completions of at most 3 tokens per step,
    `allowed_outdated_steps = allowed`, run folder `<tmp_path>/out/<timestamp>`; each of
    `changes` is a nested table merged over it in turn (e.g.
    `{"train": {"train_policy": {"variant": "dapo"}}}`)."""
    data = {
        "train": {
            "output_dir": str(tmp_path / "out"),
            "timestamp": timestamp,
            "optm_lr": 1e-4,
            "train_batch_per_replica": groups * n_generation,
            "seed": 3,
            "train_policy": {
                "type": "grpo",
                "prompt_column_name": "prompt",
                "response_column_name": "answer",
                "reward_function": "arithmetic",
                "mini_batch": 16,
                "allowed_outdated_steps": allowed,
                "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": num_rows}},
            },
        },
        "policy": {"model_name_or_path": "tiny:qwen2", "model_max_length": 48},
        "rollout": {
            "backend": "torch",
            "n_generation": n_generation,
            "batch_size": 4,
            "max_response_length": 3,
            "max_num_seqs": 32,
            "reward_workers": 0,
        },
    }
    for change in changes:
        data = _merge(data, change)
    return config_from_dict(data, source="test")


@pytest.fixture
def grpo_job_config(tmp_path: Path) -> Any:
    """:func:`arithmetic_grpo_config` under the test's `tmp_path`."""

    def build(*changes: dict[str, Any], **kwargs: Any) -> Config:
        return arithmetic_grpo_config(tmp_path, *changes, **kwargs)

    return build


@pytest.fixture(scope="session")
def vlm_demo_sft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`configs/vlm_demo_sft.toml` run once for the session (600 SFT steps of the tiny
    Qwen3-VL, ~4 min on 2 cores), with an export at step 300 too: the run folder, holding
    `safetensors/final` and `safetensors/step_300`. Step 300 is what
    `configs/vlm_demo_warmstart.toml` (the same config stopped at 300 steps: constant learning
    rate after warm-up, same seed and data order) trains, so `make vlm-demo`'s warm start
    comes from the same run (tests/test_vision.py)."""
    from nebula_rl import local
    from nebula_rl.config import load_config
    from nebula_rl.utils.ranks import cpu_threads

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "vlm_demo_sft.toml")
    warm = load_config(root / "configs" / "vlm_demo_warmstart.toml")
    assert warm.train.max_num_steps == 300 and cfg.train.optm_decay_type is None
    for c in (cfg, warm):  # (the two differ in their length and their folder only)
        c.train.max_num_steps, c.train.timestamp = 600, "sft"
    assert cfg == warm
    cfg.train.ckpt.enable_checkpoint = True
    cfg.train.ckpt.save_freq = 300
    cfg.train.ckpt.max_keep = -1

    def build(folder: Path) -> Path:
        cfg.train.output_dir = str(folder)
        # (alone, two threads: 1.34x faster than one on 2 cores)
        with cpu_threads(solo_threads()):
            return local.run(cfg)

    return once_per_run(tmp_path_factory, "vlm-demo-sft", build)


def once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]
) -> Path:
    """What `build(folder)` returns, built once for the whole test run: under pytest-xdist each
    worker process has a session of its own, so the first to ask builds into a folder the
    workers share, under a file lock, and the others wait for it and reuse the result."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # (the workers' temporary folders share this one)
    folder, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(str(build(folder)))
    return Path(done.read_text())
