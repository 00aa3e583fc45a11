"""cosmos-rl's shipped LLM configs train with their default backend, vLLM, shrunk to CPU: a plain
GRPO one, a `colocated_separated` one (vLLM's own tensor parallelism) and a multi-turn one, each
as `nebula-rl train` runs it. Marked `vllm`: `make test-vllm` runs them in .venv-vllm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nebula_rl.config import Config, load_config
from test_multiturn import TOOL_TEMPLATE
from test_vllm_jobs import ROOT, _run, _steps

pytestmark = pytest.mark.vllm

COSMOS = ROOT / "tests" / "data" / "cosmos-rl" / "configs" / "qwen2-5"


def _shrunk(path: Path) -> Config:
    """A cosmos-rl LLM config as shipped, shrunk to CPU: the tiny Qwen2, the arithmetic task
    rewarded by the completion's length, two short steps. The rollout backend is left as the
    file has it (cosmos-rl's default: vLLM)."""
    cfg = load_config(path)
    assert cfg.rollout.backend == "vllm"
    cfg.policy.model_name_or_path = "tiny:qwen2"
    cfg.policy.model_max_length = 96
    cfg.policy.model_gradient_checkpointing = False
    cfg.train.param_dtype = cfg.train.master_dtype = "float32"
    cfg.train.optm_impl = "foreach"
    cfg.train.train_batch_per_replica = cfg.grpo.mini_batch = 8  # 4 prompts x 2
    cfg.train.max_num_steps = 2
    cfg.train.ckpt.enable_checkpoint = False
    cfg.train.force_use_hf = False
    cfg.grpo.dataset.name = "builtin:arithmetic"
    cfg.grpo.dataset.subset = ""
    cfg.grpo.dataset.split = "train"
    cfg.grpo.dataset.kwargs = {"num_samples": 8}
    cfg.grpo.prompt_column_name, cfg.grpo.response_column_name = "prompt", "answer"
    cfg.grpo.reward_function = "reward_helpers:text_length"
    cfg.rollout.n_generation, cfg.rollout.batch_size = 2, 4
    cfg.rollout.max_response_length = 6
    cfg.rollout.parallelism.n_init_replicas = cfg.policy.parallelism.n_init_replicas = 1
    cfg.logging.logger = ["console"]
    cfg.redis = ""  # (a private server, not the file's port)
    return cfg


def _check(run_dir: Path, num_rows: int = 8) -> None:
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["num_sequences"] == 8 and r["grad_norm"] > 0 for r in steps)
    ledger = json.loads((run_dir / "ledger.json").read_text())["0"]
    assert ledger["trained"] == {str(i): 1 for i in range(num_rows)}


def test_cosmos_rls_plain_grpo_config_trains_with_vllm(tmp_path):
    """qwen2-5-3b-p-fsdp1-tp1-r-tp1-pp1-grpo.toml: one policy replica, one vLLM rollout
    replica; both steps train on vLLM's groups and every prompt is trained once."""
    cfg = _shrunk(COSMOS / "qwen2-5-3b-p-fsdp1-tp1-r-tp1-pp1-grpo.toml")
    _check(_run(cfg, tmp_path))


def test_cosmos_rls_colocated_separated_config_trains_with_vllm(tmp_path):
    """qwen2-5-3b-p-fsdp2-colocated-separated-grpo.toml as laid out: a policy replica of two
    FSDP2 ranks and a vLLM rollout replica of tensor parallelism 2 (vLLM's own two workers,
    started by the replica's one process), each push loaded into both workers."""
    cfg = _shrunk(COSMOS / "qwen2-5-3b-p-fsdp2-colocated-separated-grpo.toml")
    assert cfg.mode == "colocated_separated" and cfg.rollout.parallelism.tp_size == 2
    run_dir = _run(cfg, tmp_path)
    _check(run_dir)
    log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "VllmWorker" in log and "weights of version 1 in place" in log


def test_cosmos_rls_multi_turn_config_trains_with_vllm(tmp_path):
    """qwen2-5-multiturn-3b-...-grpo.toml (tool calls, thinking) with a tool chat template of
    our own: a vLLM rollout replica runs the conversations, each turn a new request over the
    cached context."""
    cfg = _shrunk(COSMOS / "qwen2-5-multiturn-3b-p-fsdp1-tp1-r-tp1-pp1-grpo.toml")
    assert cfg.rollout.multi_turn_config.enable
    template = tmp_path / "tool_template.jinja2"
    template.write_text(TOOL_TEMPLATE)
    cfg.rollout.multi_turn_config.custom_chat_template_path = str(template)
    cfg.policy.model_max_length = 512
    cfg.rollout.max_response_length = 24
    _check(_run(cfg, tmp_path))
