"""The distributed runtime: scheduling rules against a real Redis, and whole jobs as processes
(`nebula-rl train`: Redis, controller, a policy and a rollout replica under torchrun)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from nebula_rl.config import Config, config_from_dict
from nebula_rl.controller import JobState, RedisServer, connect, start_redis
from nebula_rl.controller.scheduler import Scheduler
from nebula_rl.data import rl_rows
from nebula_rl.protocol import Completion, RolloutGroup

NUM_ROWS, BATCH = 24, 4


def _cfg(tmp_path: Path, *, allowed: int, **grpo: object) -> Config:
    return config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path / "out"),
                "timestamp": f"run-{allowed}",
                "optm_lr": 1e-4,
                "train_batch_per_replica": BATCH * 4,
                "seed": 3,
                "train_policy": {
                    "type": "grpo",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "reward_function": "arithmetic",
                    "mini_batch": 16,
                    "allowed_outdated_steps": allowed,
                    "dataset": {
                        "name": "builtin:arithmetic",
                        "kwargs": {"num_samples": NUM_ROWS},
                    },
                    **grpo,
                },
            },
            "policy": {"model_name_or_path": "tiny:qwen2", "model_max_length": 48},
            "rollout": {
                "backend": "torch",
                "n_generation": 4,
                "batch_size": 4,
                "max_response_length": 3,
                "max_num_seqs": 32,
                "reward_workers": 1,
            },
        },
        source="test",
    )


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with start_redis(data_dir=tmp_path / "redis") as server:
        yield server


def _scheduler(cfg: Config, redis_server: RedisServer, tmp_path: Path) -> Scheduler:
    rows = rl_rows(cfg)
    state = JobState(connect(redis_server.url), "job")
    # A policy replica has joined: its group generation is published and it confirmed it.
    record = state.publish_group("policy", ["policy-0"], ids={"policy-0": 1})
    state.confirm_member("policy", record["generation"], "policy-0", {"version": 0})
    return Scheduler(
        cfg, state, rows=rows, total_steps=len(rows) // BATCH, num_rollout=1, run_dir=tmp_path
    )


def _answer(scheduler: Scheduler, *, version: int, reward: float = 1.0) -> list[str]:
    """Play a rollout replica: claim every released prompt, push its group at `version`."""
    state, ids = scheduler.state, []
    for msg_id, prompt in state.claim_prompts("rollout-0", 100):
        done = Completion([5, 2], [-0.5, -0.1], "7", "stop", [(0, version)], reward=reward)
        other = Completion([6, 2], [-0.5, -0.1], "8", "stop", [(0, version)], reward=0.0)
        extra = {"filtered": True} if reward == 0.0 else {}
        state.push_group(RolloutGroup(prompt, [1, 2], [done, other], "rollout-0", extra))
        state.ack_prompts([msg_id])
        ids.append(prompt.prompt_id)
    return ids


@pytest.mark.parametrize("allowed", [0, 1, 2])
def test_prompts_are_released_up_to_the_staleness_bound(tmp_path, redis_server, allowed):
    scheduler = _scheduler(_cfg(tmp_path, allowed=allowed), redis_server, tmp_path)
    assert scheduler.release_prompts() == (1 + allowed) * BATCH
    assert scheduler.release_prompts() == 0  # nothing more until the next version
    claimed = scheduler.state.claim_prompts("rollout-0", 100)
    assert {p.min_version for _, p in claimed} == {0}
    scheduler.state.bump_policy_version()
    assert scheduler.release_prompts() == BATCH
    newest = scheduler.state.claim_prompts("rollout-0", 100)
    # The new prompts may only be generated with the newest weights.
    assert [p.min_version for _, p in newest] == [1] * BATCH


def test_stale_groups_are_requeued_not_trained(tmp_path, redis_server):
    scheduler = _scheduler(_cfg(tmp_path, allowed=1), redis_server, tmp_path)
    state = scheduler.state
    scheduler.release_prompts()
    _answer(scheduler, version=0)
    scheduler.judge_groups(block_ms=0)
    assert state.buffer_size() == 2 * BATCH
    for _ in range(2):  # the policy moves on while the groups wait in the buffer
        state.bump_policy_version()
    scheduler.schedule_step()
    assert scheduler._plan is None  # every buffered group is now 2 versions old
    assert state.buffer_size() == 0
    summary = state.ledger_summary(0)
    assert summary["stale_dropped"] == 2 * BATCH and summary["requeued"] == 2 * BATCH
    requeued = state.claim_prompts("rollout-0", 100)
    assert len(requeued) == 2 * BATCH and {p.min_version for _, p in requeued} == {2}


def test_filtered_groups_are_replaced_by_new_prompts(tmp_path, redis_server):
    cfg = _cfg(tmp_path, allowed=0, variant="dapo")
    scheduler = _scheduler(cfg, redis_server, tmp_path)
    scheduler.release_prompts()
    _answer(scheduler, version=0, reward=0.0)  # all-equal groups: the rollout filters them
    scheduler.judge_groups(block_ms=0)
    assert scheduler.state.ledger_summary(0)["filtered"] == BATCH
    assert scheduler.release_prompts() == BATCH  # their places go to fresh prompts


def _run_job(tmp_path: Path, cfg: Config, *extra: str) -> Path:
    config = tmp_path / "job.json"
    config.write_text(cfg.model_dump_json())
    run_dir = Path(cfg.train.output_dir) / cfg.train.timestamp
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(run_dir.glob("logs/*.log"))
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{logs}"
    return run_dir


def _check_job(run_dir: Path, *, allowed: int, num_policy: int = 1) -> list[dict]:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, NUM_ROWS // (BATCH * num_policy) + 1))
    assert [m["policy_version"] for m in steps] == [m["step"] for m in steps]
    for m in steps:
        for key in ("reward_mean", "reward_std", "loss", "entropy", "response_length_mean"):
            assert isinstance(m[key], float), key
        assert m["num_tokens"] > 0 and m["rollout_tokens_per_s"] > 0 and m["step_time"] > 0
        assert 0 <= m["staleness_mean"] <= m["staleness_max"] <= allowed
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert list(ledger) == ["0"]
    # Every prompt of the epoch trained exactly once.
    assert ledger["0"]["trained"] == {str(i): 1 for i in range(NUM_ROWS)}
    assert ledger["0"]["summary"]["trained_more_than_once"] == 0
    model = AutoModelForCausalLM.from_pretrained(run_dir / "safetensors" / "final")
    assert model.config.model_type == "qwen2"
    for m in steps:  # the step's metrics describe the whole global batch
        assert m["num_sequences"] == BATCH * num_policy * 4  # n_generation = 4
    names = ["controller", "rollout-0"] + [f"policy-{r}" for r in range(num_policy)]
    for name in names:
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    return steps


def test_async_job_end_to_end(tmp_path):
    """Controller, Redis, a policy and a rollout replica as processes, one step of staleness."""
    run_dir = _run_job(tmp_path, _cfg(tmp_path, allowed=1))
    steps = _check_job(run_dir, allowed=1)
    # The pipeline overlaps: after the first steps, batches come from the previous weights.
    assert max(m["staleness_max"] for m in steps) == 1


@pytest.mark.slow
def test_sync_job_end_to_end(tmp_path):
    """allowed_outdated_steps = 0: every step trains on samples of the current weights."""
    run_dir = _run_job(tmp_path, _cfg(tmp_path, allowed=0))
    _check_job(run_dir, allowed=0)


def test_two_policy_replicas_train_one_global_batch(tmp_path):
    """`--policy 2`: each step trains 2 x train_batch_per_replica groups, split between two
    data-parallel policy replicas; every prompt is still trained exactly once."""
    run_dir = _run_job(tmp_path, _cfg(tmp_path, allowed=1), "--policy", "2")
    _check_job(run_dir, allowed=1, num_policy=2)
    logs = [(run_dir / "logs" / f"policy-{r}.log").read_text() for r in range(2)]
    assert sum("exported" in log for log in logs) == 1  # policy rank 0 alone exports


def test_job_resumes_from_its_checkpoint(tmp_path):
    """A job stopped after step 3 (checkpoints at steps 2 and 3) and run again from the step-2
    checkpoint continues at step 3: the policy loads its checkpoint and the controller puts the
    job's Redis state back to step 2 (Redis itself persisted step 3), so step 3's prompts are
    trained again and the epoch still trains every prompt exactly once."""
    cfg = _cfg(tmp_path, allowed=0)
    cfg.train.ckpt.enable_checkpoint, cfg.train.ckpt.save_freq = True, 2
    cfg.train.max_num_steps = 3
    run_dir = _run_job(tmp_path, cfg)
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "controller" / "step_2.json").exists()

    cfg.train.max_num_steps = None
    cfg.train.resume = str(run_dir / "checkpoints" / "step_2")
    _run_job(tmp_path, cfg)
    _check_job(run_dir, allowed=0)  # steps 1..6 once each, each prompt trained once
    policy_log = (run_dir / "logs" / "policy-0.log").read_text()
    assert "resumed from" in policy_log and "step_2" in policy_log
    # (step_3 is the first run's: resuming from an earlier checkpoint deletes nothing)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        "step_2",
        "step_3",
        "step_4",
        "step_6",
    ]
