"""What a run does besides training: dataloader workers, profiler traces, and the checkpoint a
scheduler's signal asks for (`train.save_ckpt_at_exit`)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nebula_rl import local
from nebula_rl.config import config_from_dict
from nebula_rl.utils.runs import complete_checkpoints


def _sft(tmp_path: Path, name: str, **train: object) -> dict:
    policy = train.pop("policy", {})
    return {
        "train": {
            "output_dir": str(tmp_path),
            "timestamp": name,
            "optm_lr": 1e-3,
            "optm_warmup_steps": 0,
            "train_batch_per_replica": 4,
            "max_num_steps": 3,
            "seed": 3,
            "ckpt": {"export_safetensors": False},
            **train,
            "train_policy": {
                "type": "sft",
                "prompt_column_name": "prompt",
                "response_column_name": "answer",
                "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 40}},
                **policy,  # type: ignore[dict-item]
            },
        },
        "policy": {"model_name_or_path": "tiny:qwen2", "model_max_length": 32},
    }


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dataloader_workers_tokenise_the_same_batches(tmp_path: Path) -> None:
    inline = local.run(config_from_dict(_sft(tmp_path, "inline")))
    workers = local.run(
        config_from_dict(
            _sft(tmp_path, "workers", policy={"dataloader_num_workers": 2,
                                              "dataloader_prefetch_factor": 2})
        )
    )  # fmt: skip
    a, b = _records(inline), _records(workers)
    assert [r["num_tokens"] for r in a] == [r["num_tokens"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_the_profiler_writes_a_trace_of_the_recorded_step(tmp_path: Path) -> None:
    data = _sft(tmp_path, "profiled")
    data["profiler"] = {
        "enable_profiler": True,
        "sub_profiler_config": {"wait_steps": 1, "warmup_steps": 0, "active_steps": 1},
    }
    run_dir = local.run(config_from_dict(data))
    (trace,) = (run_dir / "profile_trace" / "sft_0").glob("*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)
    assert any("ProfilerStep#1" in n for n in names)  # the second step, after one of waiting
    assert not any("ProfilerStep#0" in n for n in names)


def _train_until_signalled(tmp_path: Path, data: dict, *, steps_before: int) -> tuple[Path, int]:
    """Run `nebula-rl train` on `data`, send SIGUSR1 once `steps_before` steps are recorded;
    the run folder and the exit code."""
    config = tmp_path / f"{data['train']['timestamp']}.json"
    config.write_text(json.dumps(data))
    run_dir = tmp_path / data["train"]["timestamp"]
    process = subprocess.Popen(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config), "--local"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps_before):
        assert process.poll() is None, process.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    code = process.wait(timeout=240)
    return run_dir, code


def test_sft_saves_a_checkpoint_and_stops_on_the_signal(tmp_path: Path) -> None:
    data = _sft(tmp_path, "sft-signal", max_num_steps=400)
    data["train"]["train_policy"]["dataset"]["kwargs"]["num_samples"] = 1600
    run_dir, code = _train_until_signalled(tmp_path, data, steps_before=2)
    assert code == 0
    steps = [r["step"] for r in _records(run_dir)]
    saved = [step for step, _ in complete_checkpoints(run_dir)]
    # Checkpointing is off in the config: the signal alone asked for this one, after the step
    # that was running, and the run stopped there.
    assert len(saved) == 1 and saved[0] == steps[-1] < 400


def test_rl_saves_a_checkpoint_on_the_signal_and_goes_on(tmp_path: Path) -> None:
    data = {
        "train": {
            "output_dir": str(tmp_path),
            "timestamp": "rl-signal",
            "optm_lr": 1e-4,
            "train_batch_per_replica": 8,
            "max_num_steps": 12,
            "ckpt": {"export_safetensors": False},
            "train_policy": {
                "type": "grpo",
                "reward_function": "arithmetic",
                "mini_batch": 16,
                "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 200}},
            },
        },
        "policy": {"model_name_or_path": "tiny:qwen2", "model_max_length": 32},
        "rollout": {"backend": "torch", "n_generation": 4, "max_response_length": 3},
    }
    run_dir, code = _train_until_signalled(tmp_path, data, steps_before=2)
    assert code == 0
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 13))  # it went on to the end
    saved = [step for step, _ in complete_checkpoints(run_dir)]
    assert len(saved) == 1 and 2 <= saved[0] < 12
