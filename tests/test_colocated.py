"""Colocated mode for language models (`mode = "colocated"`, docs/colocated.md): its config rules,
its layout (no rollout replica), and whole jobs as processes: the same samples and losses as
`nebula-rl train --local`, cosmos-rl's colocated recipe shrunk to CPU, and the demo learning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nebula_rl.config import Config, ConfigError, config_from_dict, load_config
from nebula_rl.launch import launch
from nebula_rl.launch.preflight import preflight
from nebula_rl.launch.slurm import SlurmJob, render_sbatch

ROOT = Path(__file__).resolve().parents[1]
COSMOS = ROOT / "tests" / "data" / "cosmos-rl" / "configs" / "qwen2-5"
RECIPE = COSMOS / "qwen2-5-3b-p-fsdp2-colocated-grpo.toml"


def _refusals(changes: dict) -> str:
    base = {"mode": "colocated", "rollout": {"backend": "torch"}}
    for key, value in changes.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError) as err:
        config_from_dict(base, source="c.toml")
    return str(err.value)


def test_colocated_config_rules_name_the_key_and_why() -> None:
    cfg = config_from_dict({"mode": "colocated", "rollout": {"backend": "example_hf"}})
    assert cfg.mode == "colocated"  # (cosmos-rl's engine for the mode: the torch engine here)
    said = _refusals({"rollout": {"backend": "vllm"}})
    assert 'c.toml: rollout.backend = "vllm": mode = "colocated" generates' in said
    assert "colocated_separated" in said  # (where vLLM runs on the policy's GPUs)
    said = _refusals({"rollout": {"backend": "torch", "parallelism": {"tp_size": 2}}})
    assert "rollout.parallelism.tp_size = 2 with mode" in said
    said = _refusals({"policy": {"parallelism": {"dp_shard_size": 2}}})
    assert "rollout.parallelism.dp_shard_size = 1: in mode" in said and "(2)" in said
    said = _refusals({"policy": {"parallelism": {"pp_size": 2}}})
    assert "policy.parallelism.pp_size = 2 with mode" in said
    said = _refusals({"policy": {"parallelism": {"n_init_replicas": 2}}})
    assert "rollout.parallelism.n_init_replicas = 1: in mode" in said
    said = _refusals({"train": {"sync_weight_interval": 2}})
    assert "train.sync_weight_interval = 2: in mode" in said
    said = _refusals({"train": {"train_policy": {"type": "grpo", "uncentralized_training": True}}})
    assert "uncentralized_training = true" in said and "controller's ledger" in said
    said = _refusals({"train": {"train_policy": {"type": "sft"}}})
    assert 'mode = "colocated": colocated mode is for RL' in said
    # Outside colocated mode example_hf stays refused, and vLLM is allowed.
    with pytest.raises(ConfigError, match=r'rollout.backend = "example_hf": .* mode = "colocated"'):
        config_from_dict({"rollout": {"backend": "example_hf"}})
    assert config_from_dict({"rollout": {"backend": "vllm"}}).rollout.backend == "vllm"


def test_cosmos_colocated_recipe_loads_and_lays_out_no_rollout_replica(tmp_path: Path) -> None:
    cfg = load_config(RECIPE)
    assert cfg.mode == "colocated" and cfg.rollout.backend == "example_hf"
    assert any('"custom_grpo_example"' in w for w in cfg.warnings)  # (its GRPO trainer)
    notes = preflight(cfg).notes
    assert "layout: 4 device(s) or CPU processes (policy 2 x 2, every rank also generating" in (
        "\n".join(notes)
    )
    with pytest.raises(ValueError, match=r'--rollout 1: mode = "colocated" starts no rollout'):
        launch(cfg, run_dir=tmp_path, num_rollout=1)
    script = render_sbatch(cfg, SlurmJob(config_path=RECIPE, num_nodes=1, gpus_per_node=4))
    assert "NUM_ROLLOUT=0\n" in script  # (it starts the two policy replicas only)
    with pytest.raises(ValueError, match=r'--rollout 2: mode = "colocated" starts no rollout'):
        render_sbatch(cfg, SlurmJob(config_path=RECIPE, num_nodes=1, num_rollout=2))
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "check", "--config", str(RECIPE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_controller_refuses_rollout_replicas_and_requeues_a_rejoining_replicas_prompts(
    redis_server,
) -> None:
    """In colocated mode a rollout replica would never get the policy's weights: its
    registration is refused, naming the mode. A colocated replica that rejoins under its old
    name (restarted) gives back the prompts it held, as a rollout replica does."""
    import httpx

    from nebula_rl.controller import JobState, connect, create_app, serve
    from nebula_rl.protocol import Prompt

    state = JobState(connect(redis_server.url), "job")
    token = "test-token-0123456789"
    auth = {"Authorization": f"Bearer {token}"}
    app = create_app(state=state, config_json={"mode": "colocated"}, token=token)
    with serve(app) as server, httpx.Client(base_url=server.url, timeout=10.0) as client:
        rollout = {"name": "rollout-0", "role": "rollout", "host": "h", "world_size": 1}
        reply = client.post("/api/replica/register", json=rollout, headers=auth)
        assert reply.status_code == 409
        assert reply.json()["detail"].startswith('mode = "colocated": the policy replicas')
        policy = {**rollout, "name": "policy-0", "role": "policy"}
        assert client.post("/api/replica/register", json=policy, headers=auth).status_code == 200
        state.enqueue_prompts([Prompt(f"0:{i}", 0, i, "1+1", "2") for i in range(3)])
        assert len(state.claim_prompts("policy-0", 2)) == 2
        assert client.post("/api/replica/register", json=policy, headers=auth).status_code == 200
        assert state.ledger_summary(0)["requeued"] == 2


def _train(config: Config, where: Path, *extra: str) -> None:
    """`nebula-rl train` of `config`, the test rewards importable (`reward_helpers`)."""
    path = where / f"{config.train.timestamp}.json"
    path.write_text(config.model_dump_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    run_dir = Path(config.train.output_dir) / config.train.timestamp
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(run_dir.glob("logs/*.log"))
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{logs}"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(run_dir: Path) -> list[dict]:
    """The training steps' records (validation records of their own left out)."""
    return [r for r in _records(run_dir) if "policy_version" in r]


LENGTH_REWARDED = {
    "mode": "colocated",
    "train": {
        "train_policy": {
            "reward_function": "reward_helpers:text_length",
            "dataset": {"test_size": 4},
        }
    },
}
"""A colocated job rewarded by its completions' length (an untrained model's groups then
differ, so its gradients are not 0), 4 of its rows held out."""


def _same_steps_as_local(config: Config, where: Path, more: tuple[str, ...] = ()) -> list[dict]:
    """Train `config` (timestamp "colocated") and its `--local` run (timestamp "local"): three
    steps each with the same rewards, losses, gradient norms, token counts (and `more`), bit
    for bit; the colocated run's step records."""
    _train(config, where)
    config.train.timestamp = "local"
    _train(config, where, "--local")
    colocated, local = _steps(where / "out" / "colocated"), _steps(where / "out" / "local")
    assert [r["step"] for r in colocated] == [r["step"] for r in local] == [1, 2, 3]
    keys = ("reward_mean", "reward_std", "loss", "grad_norm", "num_tokens", *more)
    for ours, theirs in zip(colocated, local, strict=True):
        for key in keys:
            assert ours[key] == theirs[key], (ours["step"], key, ours[key], theirs[key])
    return colocated


@pytest.mark.slow  # (~60 s on 2 busy cores: a job of processes and a --local run)
def test_colocated_job_trains_on_the_samples_and_losses_of_the_local_run(
    tmp_path, grpo_job_config
) -> None:
    """One colocated replica (controller, Redis, the replica's process) and `--local` (one
    process) on the same config and seed, synchronous: bit for bit the same rewards (the same
    samples), losses, entropies and gradient norms, step by step, and the same validation
    rewards (before training, at step 2 and after the last). The reward is the completion's
    length, so an untrained model's groups differ and the gradients are not 0."""
    change = {
        **LENGTH_REWARDED,
        "validation": {"enable": True, "val_before_train": True, "freq": 2, "n_generation": 2},
    }
    cfg = grpo_job_config(change, num_rows=16, groups=4, allowed=0, timestamp="colocated")
    colocated = _same_steps_as_local(cfg, tmp_path, ("entropy",))
    for ours in colocated:
        assert ours["grad_norm"] > 0 and ours["reward_std"] > 0
        assert ours["staleness_max"] == 0
    validations = [
        {
            r["step"]: r["val/reward_mean"]
            for r in _records(tmp_path / "out" / name)
            if "val/reward_mean" in r
        }
        for name in ("colocated", "local")
    ]
    assert validations[0] == validations[1] and list(validations[0]) == [0, 2, 3]
    run_dir = tmp_path / "out" / "colocated"
    assert not list(run_dir.glob("logs/rollout-*.log"))  # no rollout replica ran
    ledger = json.loads((run_dir / "ledger.json").read_text())["0"]
    assert ledger["trained"] == {str(i): 1 for i in range(12)}  # every prompt once, via the ledger
    trained = json.loads((tmp_path / "out" / "local" / "trained_prompts.json").read_text())
    assert len(trained) == 12


@pytest.mark.slow  # (~75 s on 2 cores: two jobs of processes and a --local run)
def test_a_colocated_multi_turn_job_trains_on_the_samples_of_the_local_run(
    tmp_path, grpo_job_config
) -> None:
    """Multi-turn conversations (the arithmetic environment's opening as the prompt, a turn
    that ends getting the dataset's question as an observation) in a colocated replica and in
    `--local`, synchronous, on the same config and seed: bit for bit the same rewards (the
    scored texts are the conversations' last turns), losses and gradient norms, step by step.
    Then a colocated replica of 2 ranks, each running the environments of the samples it
    generates: every prompt trained once."""
    change = {
        **LENGTH_REWARDED,
        "policy": {"model_max_length": 192},
        "rollout": {
            "max_response_length": 96,  # (room for a question after a first turn that ends)
            "multi_turn_config": {
                "enable": True,
                "environment": "arithmetic",
                "max_assistant_turns": 2,
            },
        },
    }
    cfg = grpo_job_config(change, num_rows=16, groups=4, allowed=0, timestamp="colocated")
    assert all(ours["grad_norm"] > 0 for ours in _same_steps_as_local(cfg, tmp_path))

    cfg.train.timestamp = "two_ranks"
    cfg.policy.parallelism.dp_shard_size = cfg.rollout.parallelism.dp_shard_size = 2
    _train(cfg, tmp_path)
    assert [r["step"] for r in _steps(tmp_path / "out" / "two_ranks")] == [1, 2, 3]
    ledger = json.loads((tmp_path / "out" / "two_ranks" / "ledger.json").read_text())["0"]
    assert ledger["trained"] == {str(i): 1 for i in range(12)}


@pytest.mark.slow  # (~65 s on 2 busy cores; the recipe's two replicas took ~95 s)
def test_cosmos_colocated_recipe_runs_shrunk_to_cpu(tmp_path: Path) -> None:
    """cosmos-rl's qwen2-5-3b colocated recipe (a colocated replica of two FSDP2 ranks, its
    example_hf engine and example trainer), with the model, data and sizes shrunk, and one
    replica instead of two (the replicas' data parallelism is the policy replicas' own, tested
    in test_runtime.py): the ranks gather their shards into their engines, each generates half
    of every round, and the job trains every prompt once."""
    cfg = load_config(RECIPE)
    assert cfg.policy.parallelism.dp_shard_size == cfg.rollout.parallelism.dp_shard_size == 2
    cfg.policy.parallelism.n_init_replicas = cfg.rollout.parallelism.n_init_replicas = 1
    cfg.policy.model_name_or_path = "tiny:qwen2"
    cfg.policy.model_max_length = 48
    cfg.policy.model_gradient_checkpointing = False
    cfg.train.output_dir = str(tmp_path / "out")
    cfg.train.timestamp = "recipe"
    cfg.train.train_batch_per_replica = 8  # 4 prompts x n_generation 2
    cfg.train.param_dtype = "float32"  # (CPU)
    cfg.train.max_num_steps = 2
    cfg.train.train_policy.dataset.name = "builtin:arithmetic"
    cfg.train.train_policy.dataset.subset = ""
    cfg.train.train_policy.dataset.kwargs = {"num_samples": 8}
    cfg.train.train_policy.prompt_column_name = "prompt"
    cfg.train.train_policy.response_column_name = "answer"
    cfg.train.train_policy.reward_function = "reward_helpers:text_length"
    cfg.rollout.n_generation = 2
    cfg.rollout.batch_size = 4
    cfg.rollout.max_response_length = 3
    cfg.logging.logger = ["console"]
    cfg.redis = ""  # (a private server, not the recipe's port 12808)
    _train(cfg, tmp_path)
    run_dir = tmp_path / "out" / "recipe"
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["num_sequences"] == 8 and r["grad_norm"] > 0 for r in steps)
    ledger = json.loads((run_dir / "ledger.json").read_text())["0"]
    assert ledger["trained"] == {str(i): 1 for i in range(8)}
    assert not list(run_dir.glob("logs/rollout-*.log"))


@pytest.mark.slow  # (~45 s on 2 busy cores: 16 steps after ~20 s of start-up)
def test_colocated_replica_learns_with_its_own_rollouts(tmp_path, grpo_job_config) -> None:
    """The tiny model from scratch, rewarded by the length of its 3-token completions (4 prompts
    x 8 completions a step, lr 5e-3): the mean reward of the last 4 of 16 steps is at least
    0.03 above that of the first 4 (measured: 0.231 -> 0.284). Each step's weights must reach the
    replica's engine for this: generating with the starting weights stays flat."""
    change = {
        "mode": "colocated",
        "train": {
            "optm_lr": 5e-3,
            "train_policy": {"reward_function": "reward_helpers:text_length", "mini_batch": 32},
        },
    }
    cfg = grpo_job_config(change, num_rows=64, groups=4, n_generation=8, allowed=0)
    _train(cfg, tmp_path)
    rewards = [r["reward_mean"] for r in _steps(tmp_path / "out" / "run")]
    assert len(rewards) == 16
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last - first >= 0.03, (first, last, rewards)
