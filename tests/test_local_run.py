"""The single-process run end to end on the tiny preset: files written, model exported."""

import json

import torch
from transformers import AutoModelForCausalLM

from nebula_rl import local
from nebula_rl.config import config_from_dict
from nebula_rl.launch import ensure_model


def _rl_cfg(tmp_path, model, **train):
    return config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "timestamp": "rl",
                "optm_lr": 1e-4,
                "train_batch_per_replica": 16,
                "max_num_steps": 3,
                **train,
                "train_policy": {
                    "type": "grpo",
                    "variant": "dapo",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "reward_function": "arithmetic",
                    "mini_batch": 16,
                    "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 40}},
                },
            },
            "policy": {"model_name_or_path": model},
            "rollout": {"backend": "torch", "n_generation": 4, "max_response_length": 3},
        }
    )


def test_sft_warmstart_then_grpo_writes_metrics_and_export(tmp_path):
    sft = tmp_path / "sft.toml"
    sft.write_text(
        f"""
[train]
output_dir = "{tmp_path}"
timestamp = "warm"
optm_lr = 1e-3
train_batch_per_replica = 8
max_num_steps = 2
[train.train_policy]
type = "sft"
prompt_column_name = "prompt"
response_column_name = "answer"
[train.train_policy.dataset]
name = "builtin:arithmetic"
kwargs = {{ num_samples = 32 }}
[policy]
model_name_or_path = "tiny:qwen2"
"""
    )
    warm = tmp_path / "warm" / "safetensors" / "final"
    cfg = _rl_cfg(tmp_path, str(warm))
    cfg.policy.warmstart_config = str(sft)
    cfg.grpo.dynamic_sampling = False
    ensure_model(cfg)  # the warm start runs as its own `nebula-rl train` process
    run_dir = local.run(cfg)

    assert len((tmp_path / "warm" / "metrics.jsonl").read_text().splitlines()) == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert r["num_sequences"] == 16
        for key in ("loss", "entropy", "response_length_mean", "step_time", "rollout_tokens_per_s"):
            assert key in r
    trained = json.loads((run_dir / "trained_prompts.json").read_text())
    assert len(trained) == len(set(trained)) == 12
    model = AutoModelForCausalLM.from_pretrained(run_dir / "safetensors" / "final")
    assert model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == model.config.vocab_size
