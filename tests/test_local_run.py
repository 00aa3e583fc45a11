"""The single-process run end to end on the tiny preset: files written, model exported."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from nebula_rl import local
from nebula_rl.config import config_from_dict
from nebula_rl.launch import ensure_model
from nebula_rl.utils.validation import VALIDATION_KEYS


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
        for key in (
            "loss",
            "entropy",
            "response_length_mean",
            "step_time",
            "generate_time",
            "train_time",
            "weight_update_time",
            "rollout_tokens_per_s",
        ):
            assert key in r
    trained = json.loads((run_dir / "trained_prompts.json").read_text())
    assert len(trained) == len(set(trained)) == 12
    model = AutoModelForCausalLM.from_pretrained(run_dir / "safetensors" / "final")
    assert model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == model.config.vocab_size


VAL_CALLS: list[str] = []


def text_reward(completion: str, reference: str) -> float:
    """Varies with the text (the tiny model's answers are never right)."""
    return sum(map(ord, completion)) % 7 / 7


def val_reward(completion: str, reference: str, *, custom: dict) -> float:
    """A validation reward that takes the config's `[custom]` table."""
    VAL_CALLS.append(completion)
    return custom["offset"] + text_reward(completion, reference)


def zero_reward(completion: str, reference: str) -> float:
    return 0.0


def _val_cfg(tmp_path, *, timestamp: str, validation: dict, **train):
    cfg = _rl_cfg(tmp_path, "tiny:qwen2", **train)
    data = cfg.model_dump(mode="json")
    data["train"]["timestamp"] = timestamp
    data["train"]["train_policy"]["variant"] = "grpo"
    data["train"]["train_policy"]["dataset"]["test_size"] = 6
    data["validation"] = {
        "enable": True,
        "reward_function": f"{__name__}:val_reward",
        "max_num_prompts": 5,
        "n_generation": 2,
        "max_response_length": 2,
        **validation,
    }
    data["custom"] = {"offset": 10.0}
    return config_from_dict(data, source="test", resolved=True)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_local_validation_schedule_rewards_and_records(tmp_path):
    VAL_CALLS.clear()
    cfg = _val_cfg(
        tmp_path,
        timestamp="val",
        validation={"val_before_train": True, "freq": 2},
        max_num_steps=5,
        train_batch_per_replica=8,
    )
    records = _records(local.run(cfg))
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    validated = [r["step"] for r in records if "val/reward_mean" in r]
    assert validated == [0, 2, 4, 5]  # before training, every 2 steps, after the last
    assert set(records[0]) == {"step", *VALIDATION_KEYS}  # step 0: a record of its own
    for r in records:
        if r["step"] in validated:
            # validation.reward_function with custom.offset = 10, on 5 prompts x 2 completions
            assert r["val/rollout_count"] == 10 and r["val/reward_min"] >= 10.0
            assert r["val/reward_max"] < 11.0 and r["val/policy_version"] == r["step"]
            assert r["val/response_length_mean"] <= 2
        if r["step"] > 0:
            assert 0.0 <= r["reward_mean"] <= 1.0  # training: the arithmetic reward
    assert len(VAL_CALLS) == 4 * 10


def test_local_greedy_validation_repeats_for_identical_weights(tmp_path):
    """Two runs with other sampling seeds validate the same initial weights: greedy (temperature
    0) gives the same numbers; sampling at temperature 1 gives others."""

    def step0(timestamp: str, seed: int, **validation) -> dict:
        cfg = _val_cfg(
            tmp_path,
            timestamp=timestamp,
            validation={"val_before_train": True, "max_response_length": 3, **validation},
            max_num_steps=1,
            train_batch_per_replica=8,
        )
        cfg.rollout.seed = seed
        return _records(local.run(cfg))[0]

    greedy = [step0(f"greedy-{seed}", seed) for seed in (1, 2)]
    assert greedy[0] == greedy[1]
    sampled = [step0(f"t1-{seed}", seed, temperature=1.0, top_k=-1) for seed in (1, 2)]
    assert sampled[0]["val/reward_mean"] != sampled[1]["val/reward_mean"]
    assert sampled[0] != greedy[0]


def test_local_dynamic_sampling_filters_on_the_named_rewards_and_gives_up(tmp_path):
    """filter_reward_metric: a constant total reward is no reason to drop a group when the named
    reward varies; without it, every group is dropped until max_retry_for_on_policy ends the
    run."""
    cfg = _rl_cfg(tmp_path, "tiny:qwen2", max_num_steps=1, train_batch_per_replica=8)
    cfg.grpo.reward_function = {f"{__name__}:zero_reward": 1.0}
    cfg.grpo.filter_reward_metric = [f"{__name__}:text_reward"]
    cfg.grpo.max_retry_for_on_policy = 2
    [record] = _records(local.run(cfg))
    assert record["reward_mean"] == 0.0 and record["groups_dropped"] < 2
    cfg.grpo.filter_reward_metric = []
    cfg.train.timestamp = "no-metric"
    with pytest.raises(RuntimeError, match="max_retry_for_on_policy = 2"):
        local.run(cfg)


def test_local_generates_and_trains_with_each_roles_cpu_threads(tmp_path, monkeypatch):
    """`rollout.cpu_threads` while the engine generates, `policy.cpu_threads` while the policy
    trains, the process's own count again after (spies around the real methods)."""
    from nebula_rl.policy.trainer import PolicyTrainer
    from nebula_rl.rollout.torch_engine import TorchEngine

    seen: dict[str, set[int]] = {"generate": set(), "train": set()}
    generate, grpo_step = TorchEngine.generate, PolicyTrainer.grpo_step

    def spy_generate(self, *args, **kwargs):
        seen["generate"].add(torch.get_num_threads())
        return generate(self, *args, **kwargs)

    def spy_grpo_step(self, *args, **kwargs):
        seen["train"].add(torch.get_num_threads())
        return grpo_step(self, *args, **kwargs)

    monkeypatch.setattr(TorchEngine, "generate", spy_generate)
    monkeypatch.setattr(PolicyTrainer, "grpo_step", spy_grpo_step)
    cfg = _rl_cfg(tmp_path, "tiny:qwen2", max_num_steps=2)
    grpo = cfg.train.train_policy.model_copy(update={"variant": "grpo"})  # (no group filtered)
    cfg = cfg.model_copy(
        update={
            "train": cfg.train.model_copy(update={"train_policy": grpo}),
            "policy": cfg.policy.model_copy(update={"cpu_threads": 1}),
            "rollout": cfg.rollout.model_copy(update={"cpu_threads": 2}),
        }
    )
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        local.run(cfg)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert seen == {"generate": {2}, "train": {1}}
