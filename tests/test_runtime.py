"""The distributed runtime: scheduling rules against a real Redis, and whole jobs as processes
(`nebula-rl train`: Redis, controller, a policy and a rollout replica under torchrun)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from nebula_rl.config import Config
from nebula_rl.controller import JobState, RedisServer, connect
from nebula_rl.controller.scheduler import Scheduler
from nebula_rl.data import rl_rows
from nebula_rl.protocol import Completion, RolloutGroup

NUM_ROWS, BATCH = 24, 4


def _cfg(grpo_job_config, *, allowed: int, changes: dict | None = None, **grpo: object) -> Config:
    """The arithmetic job (conftest) with `allowed` staleness, these `[train.train_policy]` keys
    and `changes`, scored in a reward process."""
    return grpo_job_config(
        {"train": {"train_policy": grpo}, "rollout": {"reward_workers": 1}},
        changes or {},
        timestamp=f"run-{allowed}",
        num_rows=NUM_ROWS,
        groups=BATCH,
        allowed=allowed,
    )


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
def test_prompts_are_released_up_to_the_staleness_bound(
    tmp_path, grpo_job_config, redis_server, allowed
):
    scheduler = _scheduler(_cfg(grpo_job_config, allowed=allowed), redis_server, tmp_path)
    assert scheduler.release_prompts() == (1 + allowed) * BATCH
    assert scheduler.release_prompts() == 0  # nothing more until the next version
    claimed = scheduler.state.claim_prompts("rollout-0", 100)
    assert {p.min_version for _, p in claimed} == {0}
    scheduler.state.bump_policy_version()
    assert scheduler.release_prompts() == BATCH
    newest = scheduler.state.claim_prompts("rollout-0", 100)
    # The new prompts may only be generated with the newest weights.
    assert [p.min_version for _, p in newest] == [1] * BATCH


def test_stale_groups_are_requeued_not_trained(tmp_path, grpo_job_config, redis_server):
    scheduler = _scheduler(_cfg(grpo_job_config, allowed=1), redis_server, tmp_path)
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


def test_filtered_groups_are_replaced_by_new_prompts(tmp_path, grpo_job_config, redis_server):
    cfg = _cfg(grpo_job_config, allowed=0, variant="dapo")
    scheduler = _scheduler(cfg, redis_server, tmp_path)
    scheduler.release_prompts()
    _answer(scheduler, version=0, reward=0.0)  # all-equal groups: the rollout filters them
    scheduler.judge_groups(block_ms=0)
    assert scheduler.state.ledger_summary(0)["filtered"] == BATCH
    assert scheduler.release_prompts() == BATCH  # their places go to fresh prompts


def test_max_inflight_steps_caps_the_prompts_out(tmp_path, grpo_job_config, redis_server):
    """Prompts handed out and not resolved (trained, or dropped by dynamic sampling) stay within
    max_inflight_steps global batches. (Loading raises the key to allowed_outdated_steps + 1,
    where the staleness release alone keeps within it; it is set below that here so that the
    ceiling is the bound that acts.)"""
    cfg = _cfg(grpo_job_config, allowed=2, variant="dapo")
    cfg.grpo.max_inflight_steps = 1
    scheduler = _scheduler(cfg, redis_server, tmp_path)
    assert scheduler.release_prompts() == BATCH  # the staleness bound alone: 3 batches
    _answer(scheduler, version=0, reward=0.0)  # all filtered: resolved, so replaced
    scheduler.judge_groups(block_ms=0)
    assert scheduler.release_prompts() == BATCH
    _answer(scheduler, version=0)  # accepted into the buffer: still out until trained
    scheduler.judge_groups(block_ms=0)
    assert scheduler.release_prompts() == 0
    assert scheduler.state.released() == 2 * BATCH


def test_too_many_dynamic_sampling_rounds_fail_the_job(tmp_path, grpo_job_config, redis_server):
    cfg = _cfg(grpo_job_config, allowed=0, variant="dapo", max_retry_for_on_policy=1)
    scheduler = _scheduler(cfg, redis_server, tmp_path)
    scheduler.release_prompts()
    _answer(scheduler, version=0, reward=0.0)  # one batch dropped: one round of replacements
    scheduler.judge_groups(block_ms=0)
    scheduler.schedule_step()
    assert scheduler.release_prompts() == BATCH and scheduler.state.finished() is None
    _answer(scheduler, version=0, reward=0.0)  # dropped again: a second round is one too many
    scheduler.judge_groups(block_ms=0)
    with pytest.raises(RuntimeError, match=r"max_retry_for_on_policy = 1"):
        scheduler.schedule_step()
    assert scheduler.state.finished().startswith("failed: dynamic sampling dropped 8 groups")


@pytest.mark.parametrize("local", [True, False])
def test_prompts_carry_their_text_only_without_local_dataset(
    tmp_path, grpo_job_config, redis_server, local
):
    cfg = _cfg(grpo_job_config, allowed=0, changes={"train": {"local_dataset": local}})
    scheduler = _scheduler(cfg, redis_server, tmp_path)
    scheduler.release_prompts()
    claimed = scheduler.state.claim_prompts("rollout-0", 100)
    assert len(claimed) == BATCH
    for _, prompt in claimed:
        row = scheduler.rows[prompt.index]
        if local:  # the rollout replica reads the row from its own copy
            assert prompt.prompt is None and prompt.reference is None
        else:
            assert (prompt.prompt, prompt.reference) == (row["prompt"], row["answer"])


def _answer_validation(state: JobState, consumer: str, count: int, *, reward: float) -> list[str]:
    """Play rollout replica `consumer` on `count` validation prompts (2 completions each)."""
    ids = []
    for msg_id, prompt in state.claim_validation(consumer, count):
        done = Completion([5, 2, 9], [], "7", "stop", [(0, prompt.min_version)], reward=reward)
        other = Completion([6], [], "8", "length", [(0, prompt.min_version)], reward=0.0)
        state.push_group(RolloutGroup(prompt, [1, 2], [done, other], consumer))
        state.ack_validation([msg_id])
        ids.append(prompt.prompt_id)
    return ids


def test_validation_prompts_are_answered_once_and_recorded_apart_from_training(
    tmp_path, grpo_job_config, redis_server
):
    cfg = _cfg(
        grpo_job_config,
        allowed=1,
        changes={
            "train": {"train_policy": {"dataset": {"test_size": 6}}},
            "validation": {"enable": True, "val_before_train": True, "max_num_prompts": 3},
        },
    )
    scheduler = _scheduler(cfg, redis_server, tmp_path)
    state = scheduler.state
    assert len(scheduler.val_rows) == 3 and len(scheduler.rows) == NUM_ROWS - 6
    scheduler.start_due_validation()
    scheduler.start_due_validation()  # (a restarted controller: nothing twice)
    assert state.pending_validations() == [0]
    assert scheduler.release_prompts() == 2 * BATCH  # validation prompts are no training prompts
    # rollout-1 takes two validation prompts and dies; rollout-0 answers one, and once more.
    held = state.claim_validation("rollout-1", 2)
    assert [(p.validation_step, p.min_version) for _, p in held] == [(0, 0), (0, 0)]
    assert _answer_validation(state, "rollout-0", 5, reward=1.0) == ["val0:2"]
    late = Completion([5], [], "7", "stop", [(0, 0)], reward=5.0)  # the dead one's, came late
    state.push_group(RolloutGroup(held[0][1], [1], [late, late], "rollout-1"))
    # Training goes on; the step waits for the validation of the weights it would replace.
    _answer(scheduler, version=0)
    scheduler.judge_groups(block_ms=0)
    assert state.buffer_size() == 2 * BATCH
    scheduler.schedule_step()
    assert scheduler._plan is None and state.step_records() == []
    assert state.requeue_pending("rollout-1") == 1  # the late answer took the other's place
    assert _answer_validation(state, "rollout-0", 5, reward=1.0) == [held[1][1].prompt_id]
    _answer_validation(state, "rollout-1", 5, reward=1.0)  # (nothing left to claim)
    state.push_group(RolloutGroup(held[1][1], [1], [late, late], "rollout-1"))  # a duplicate
    scheduler.judge_groups(block_ms=0)
    # Every prompt answered exactly once: 3 prompts x 2 completions.
    [record] = state.step_records()
    assert record["step"] == 0 and record["val/rollout_count"] == 6
    assert record["val/reward_max"] == 5.0 and record["val/reward_min"] == 0.0
    assert record["val/reward_mean"] == pytest.approx((5.0 + 5.0 + 1.0 + 0.0 + 1.0 + 0.0) / 6)
    assert record["val/response_length_mean"] == pytest.approx((1 + 1 + 3 + 1 + 3 + 1) / 6)
    assert record["val/policy_version"] == 0
    assert state.pending_validations() == [] and state.claim_validation("rollout-0", 9) == []
    scheduler.schedule_step()  # now step 1 goes out
    assert scheduler._plan is not None and scheduler._plan["step"] == 1
    summary = state.ledger_summary(0)
    assert summary["completed"] == 2 * BATCH and summary["total"] == 2 * BATCH
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [record]


def _run_job(tmp_path: Path, cfg: Config, *extra: str, env: dict | None = None) -> Path:
    config = tmp_path / "job.json"
    config.write_text(cfg.model_dump_json())
    run_dir = Path(cfg.train.output_dir) / cfg.train.timestamp
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(run_dir.glob("logs/*.log"))
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{logs}"
    return run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_job(
    run_dir: Path, *, allowed: int, num_policy: int = 1, num_rows: int = NUM_ROWS
) -> list[dict]:
    """The job trained every prompt once; its training steps' records (validation records, which
    have no `policy_version`, are left out)."""
    steps = [r for r in _records(run_dir) if "policy_version" in r]
    assert [m["step"] for m in steps] == list(range(1, num_rows // (BATCH * num_policy) + 1))
    assert [m["policy_version"] for m in steps] == [m["step"] for m in steps]
    for m in steps:
        for key in ("reward_mean", "reward_std", "loss", "entropy", "response_length_mean"):
            assert isinstance(m[key], float), key
        assert m["num_tokens"] > 0 and m["rollout_tokens_per_s"] > 0 and m["step_time"] > 0
        assert 0 <= m["staleness_mean"] <= m["staleness_max"] <= allowed
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert list(ledger) == ["0"]
    # Every prompt of the epoch trained exactly once.
    assert ledger["0"]["trained"] == {str(i): 1 for i in range(num_rows)}
    assert ledger["0"]["summary"]["trained_more_than_once"] == 0
    model = AutoModelForCausalLM.from_pretrained(run_dir / "safetensors" / "final")
    assert model.config.model_type == "qwen2"
    for m in steps:  # the step's metrics describe the whole global batch
        assert m["num_sequences"] == BATCH * num_policy * 4  # n_generation = 4
    names = ["controller", "rollout-0"] + [f"policy-{r}" for r in range(num_policy)]
    for name in names:
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    return steps


def test_async_job_end_to_end(tmp_path, grpo_job_config):
    """Controller, Redis, a policy and a rollout replica as processes, one step of staleness.
    The replicas are new interpreters (`NEBULA_FORK=0`), as on GPUs; the other jobs' replicas
    are forks of the launcher (nebula_rl.launch.forking)."""
    run_dir = _run_job(tmp_path, _cfg(grpo_job_config, allowed=1), env={"NEBULA_FORK": "0"})
    launcher = (run_dir / "logs" / "train.log").read_text()
    assert "started policy-0 (pid" in launcher and "started rollout-0 (pid" in launcher
    steps = _check_job(run_dir, allowed=1)
    # The pipeline overlaps: after the first steps, batches come from the previous weights.
    assert max(m["staleness_max"] for m in steps) == 1


@pytest.mark.slow
def test_sync_job_end_to_end(tmp_path, grpo_job_config):
    """allowed_outdated_steps = 0: every step trains on samples of the current weights."""
    run_dir = _run_job(tmp_path, _cfg(grpo_job_config, allowed=0))
    _check_job(run_dir, allowed=0)


@pytest.mark.slow  # (a second job like the one above; the pieces are fast tests elsewhere)
def test_job_with_remote_rewards_and_weight_averages(tmp_path, grpo_job_config, monkeypatch):
    """The rollout replica scores through the reward service (its REMOTE_REWARD_* variables
    inherited from the launcher), the policy replica keeps weight averages and exports them
    beside its weights (`safetensors/final_ema`)."""
    import torch
    from safetensors.torch import load_file

    from test_remote_rewards import _service, point_client_at, remote_changes

    with _service() as svc:
        point_client_at(monkeypatch, svc.url)
        changes = remote_changes({"name": "arithmetic"}, batch_size=4)
        changes["train"]["ema_enable"] = True
        run_dir = _run_job(tmp_path, _cfg(grpo_job_config, allowed=1, changes=changes))
        calls = svc.service.stats()["calls"]
    _check_job(run_dir, allowed=1)
    assert calls["arithmetic"] >= NUM_ROWS // 4 // 2  # (each group one request; some batched)
    averages = AutoModelForCausalLM.from_pretrained(run_dir / "safetensors" / "final_ema")
    final = load_file(run_dir / "safetensors" / "final" / "model.safetensors")
    state = averages.state_dict()
    assert final.keys() <= state.keys()
    assert any(not torch.equal(state[k], v) for k, v in final.items())


def test_two_policy_replicas_train_one_global_batch(tmp_path, grpo_job_config):
    """`--policy 2`: each step trains 2 x train_batch_per_replica groups, split between two
    data-parallel policy replicas; every prompt is still trained exactly once."""
    run_dir = _run_job(tmp_path, _cfg(grpo_job_config, allowed=1), "--policy", "2")
    launcher = (run_dir / "logs" / "train.log").read_text()
    for name in ("policy-0", "policy-1", "rollout-0"):  # (forks of the launcher)
        assert f"started {name} (forked" in launcher
    _check_job(run_dir, allowed=1, num_policy=2)
    logs = [(run_dir / "logs" / f"policy-{r}.log").read_text() for r in range(2)]
    assert sum("exported" in log for log in logs) == 1  # policy rank 0 alone exports


def test_job_validates_the_weights_of_the_expected_steps(tmp_path, grpo_job_config):
    """Validation before training, every 2 steps and after the last (5 steps: 0, 2, 4, 5), on the
    4 held-out rows, with the controller sending prompt texts (`train.local_dataset = false`);
    every training prompt is still trained exactly once."""
    cfg = _cfg(
        grpo_job_config,
        allowed=1,
        changes={
            "train": {"local_dataset": False, "train_policy": {"dataset": {"test_size": 4}}},
            "validation": {
                "enable": True,
                "val_before_train": True,
                "freq": 2,
                "n_generation": 2,
                "max_response_length": 2,
            },
        },
    )
    run_dir = _run_job(tmp_path, cfg)
    steps = _check_job(run_dir, allowed=1, num_rows=NUM_ROWS - 4)
    validations = [r for r in _records(run_dir) if "policy_version" not in r]
    assert [r["step"] for r in validations] == [0, 2, 4, 5]
    for r in validations:
        assert r["val/rollout_count"] == 4 * 2
        assert 1 <= r["val/response_length_mean"] <= 2
        assert r["val/policy_version"] == r["step"]  # exactly the weights of the step
        assert 0.0 <= r["val/reward_min"] <= r["val/reward_mean"] <= r["val/reward_max"] <= 1.0
        assert all(k not in r for k in ("loss", "reward_mean"))
    # A validation's record follows its step's.
    order = [(r["step"], "policy_version" in r) for r in _records(run_dir)]
    assert order.index((2, False)) == order.index((2, True)) + 1
    assert all("val/reward_mean" not in m for m in steps)


def test_job_resumes_from_its_checkpoint(tmp_path, grpo_job_config):
    """A job stopped after step 3 (checkpoints at steps 2 and 3) and run again from the step-2
    checkpoint continues at step 3: the policy loads its checkpoint and the controller puts the
    job's Redis state back to step 2 (Redis itself persisted step 3), so step 3's prompts are
    trained again and the epoch still trains every prompt exactly once."""
    cfg = _cfg(grpo_job_config, allowed=0)
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


def test_a_preemption_signal_checkpoints_the_job_which_goes_on(tmp_path, grpo_job_config):
    """SIGUSR1 to the launcher (as SLURM sends before it kills a job; train.save_ckpt_at_exit):
    the policy saves a checkpoint after the next step, with the controller's snapshot of that
    step, although checkpointing is off in the config; the job goes on to its end."""
    import signal
    import time

    from nebula_rl.utils.runs import complete_checkpoints

    cfg = _cfg(grpo_job_config, allowed=1)
    assert not cfg.train.ckpt.enable_checkpoint and cfg.train.save_ckpt_at_exit
    config = tmp_path / "job.json"
    config.write_text(cfg.model_dump_json())
    run_dir = Path(cfg.train.output_dir) / cfg.train.timestamp
    process = subprocess.Popen(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=600) == 0
    _check_job(run_dir, allowed=1)  # every prompt trained once, all steps recorded
    (step, _), *others = complete_checkpoints(run_dir)
    assert others == [] and 2 <= step <= NUM_ROWS // BATCH
    assert (run_dir / "checkpoints" / "controller" / f"step_{step}.json").exists()


MULTI_TURN = {
    "policy": {"model_max_length": 160},
    "rollout": {
        "max_response_length": 64,
        "multi_turn_config": {"enable": True, "environment": "arithmetic"},
    },
}
"""Multi-turn conversations (the arithmetic environment) with room for a second turn."""


@pytest.mark.slow  # (~23 s on 2 cores, ~35 s multi-turn: the default run stays near 15 min)
@pytest.mark.parametrize("turns", [False, True], ids=["single-turn", "multi-turn"])
def test_tensor_parallel_rollout_replica_runs_the_job(tmp_path, grpo_job_config, turns):
    """A rollout replica of 2 ranks (`rollout.parallelism.tp_size = 2`, the lock-step engine):
    both ranks take every weight push; the job trains every prompt once; also with multi-turn
    conversations, whose observations rank 0 sends the other rank with each step."""
    tp2 = {"rollout": {"parallelism": {"tp_size": 2}}}
    if turns:
        tp2 = {
            "policy": MULTI_TURN["policy"],
            "rollout": {**MULTI_TURN["rollout"], **tp2["rollout"]},
        }
    run_dir = _run_job(tmp_path, _cfg(grpo_job_config, allowed=1, changes=tp2))
    _check_job(run_dir, allowed=1)
    log = (run_dir / "logs" / "rollout-0.log").read_text()
    # The weight group's ranks: policy 0, the rollout's ranks 1 and 2.
    assert re.search(r"\[rank 0\] joined weight group generation \d+ as rank 1", log)
    assert re.search(r"\[rank 1\] joined weight group generation \d+ as rank 2", log)


@pytest.mark.slow  # (~36 s on 2 cores: the default run stays near 15 min)
def test_policy_replicas_of_two_ranks_run_the_job(tmp_path, grpo_job_config):
    """`--policy 2` replicas of two FSDP2 ranks each (`dp_shard_size = 2`) and a rollout of two
    tensor-parallel ranks: rank 0 of each replica hands its commands to rank 1, ranks `i` of the
    two replicas form a data-parallel group of their own, every policy rank pushes its shards;
    the job trains every prompt once, on the global batch, and exports once."""
    layout = {
        "policy": {"parallelism": {"dp_shard_size": 2}},
        "rollout": {"parallelism": {"tp_size": 2}},
    }
    run_dir = _run_job(tmp_path, _cfg(grpo_job_config, allowed=1, changes=layout), "--policy", "2")
    _check_job(run_dir, allowed=1, num_policy=2)
    logs = [(run_dir / "logs" / f"policy-{r}.log").read_text() for r in range(2)]
    places = []
    for log in logs:  # both ranks of a replica join the policy group at the replica's place
        found = {
            int(rank): int(place)
            for rank, place in re.findall(
                r"\[rank (\d)\] policy group generation \d+: rank (\d) of 2", log
            )
        }
        assert found.keys() == {0, 1} and found[0] == found[1], found
        places.append(found[0])
    assert sorted(places) == [0, 1]
    # The weight group: both ranks of the policy group's rank 0 send.
    sender = logs[places.index(0)]
    assert "[rank 0] weight group generation" in sender
    assert "[rank 1] weight group generation" in sender
    assert sum("exported" in log for log in logs) == 1


@pytest.mark.slow  # (~30 s on 2 cores)
def test_a_context_parallel_policy_replica_runs_the_job(tmp_path, grpo_job_config):
    """A policy replica of two context-parallel ranks (`cp_size = 2`: each sequence's tokens
    split between them, keys and values all-gathered on CPU): the job trains every prompt once
    on the global batch."""
    layout = {"policy": {"parallelism": {"cp_size": 2, "dp_shard_size": 1}}}
    run_dir = _run_job(tmp_path, _cfg(grpo_job_config, allowed=1, changes=layout))
    _check_job(run_dir, allowed=1)


@pytest.mark.slow  # (~17 s; the placement rules are fast tests in test_launch.py)
def test_colocated_separated_job_runs_end_to_end(tmp_path, grpo_job_config):
    """`mode = "colocated_separated"` (on GPUs the rollout replica shares the policy replica's;
    on CPU the same processes as disaggregated): the job trains every prompt once, the weights
    going through the shared-memory sets of a gloo weight group."""
    colocated = {"mode": "colocated_separated"}
    run_dir = _run_job(tmp_path, _cfg(grpo_job_config, allowed=1, changes=colocated))
    _check_job(run_dir, allowed=1)
    log = (run_dir / "logs" / "policy-0.log").read_text()
    assert "over gloo, through shared memory" in log
