import re
from pathlib import Path

import pytest

from nebula_rl.config import ConfigError, GrpoConfig, SftConfig, config_from_dict, load_config

# Every shipped job config; rewards.toml configures the reward service (loaded by its own
# schema in tests/test_reward_service.py), the eval configs `nebula-rl eval` (below).
_SHIPPED = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))
EVAL_CONFIGS = [p for p in _SHIPPED if "eval" in p.stem]
CONFIGS = [p for p in _SHIPPED if p.name != "rewards.toml" and p not in EVAL_CONFIGS]


def test_configs_dir_is_not_empty():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.train.train_batch_per_replica >= 1


@pytest.mark.parametrize("path", EVAL_CONFIGS, ids=lambda p: p.name)
def test_eval_configs_load_as_eval_configs_and_train_names_the_command(path):
    from nebula_rl.eval import load_eval_config

    assert load_eval_config(path).shards() >= 1
    with pytest.raises(ConfigError, match=rf"{path}: num_gpus is a key of an eval config.*eval"):
        load_config(path)


def _write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_misspelt_key_is_named_with_file(tmp_path):
    path = _write(tmp_path, "[train]\noptm_lrr = 1e-5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f'{path}: train.optm_lrr: unknown key; did you mean "optm_lr"?'


def test_unknown_key_inside_discriminated_policy_is_dotted(tmp_path):
    path = _write(tmp_path, '[train.train_policy]\ntype = "grpo"\nepsilon_lo = 0.1\n')
    with pytest.raises(
        ConfigError, match=r"job\.toml: train\.train_policy\.epsilon_lo: unknown key"
    ):
        load_config(path)


def test_bad_value_names_key(tmp_path):
    path = _write(tmp_path, "[rollout]\nn_generation = 0\n")
    with pytest.raises(ConfigError, match=r"rollout\.n_generation: Input should be greater"):
        load_config(path)


def test_zero_checkpoints_kept_is_refused(tmp_path):
    path = _write(tmp_path, "[train.ckpt]\nmax_keep = 0\n")
    with pytest.raises(ConfigError, match=r"job\.toml: train\.ckpt\.max_keep: must be -1"):
        load_config(path)


def test_invalid_toml_names_file(tmp_path):
    path = _write(tmp_path, "[train\n")
    with pytest.raises(ConfigError, match=r"job\.toml: invalid TOML"):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.toml")


def test_temperature_mismatch_recomputes_the_proximal_logprobs():
    # cosmos-rl's shipped configs often take log-probs at 0.9 and sample at 1.0: the rollout's
    # log-probs are then no proximal policy, so the policy recomputes its own.
    cfg = config_from_dict({"train": {"train_policy": {"type": "grpo", "temperature": 0.7}}})
    assert cfg.grpo.use_rollout_logprobs_for_loss is False
    with pytest.raises(ConfigError) as err:
        config_from_dict(
            {
                "train": {
                    "train_policy": {
                        "type": "grpo",
                        "temperature": 0.7,
                        "use_rollout_logprobs_for_loss": True,
                    }
                }
            }
        )
    assert "train.train_policy.temperature" in str(err.value)
    assert "rollout.sampling_config.temperature" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("gsm8k", {"gsm8k": 1.0}),
        (["gsm8k", "format"], {"gsm8k": 1.0, "format": 1.0}),
        ({"a": 0.5}, {"a": 0.5}),
    ],
)
def test_reward_function_forms(spec, expected):
    cfg = config_from_dict({"train": {"train_policy": {"type": "grpo", "reward_function": spec}}})
    assert cfg.grpo.reward_function == expected


def test_policy_type_inferred_like_cosmos():
    rl = config_from_dict({"train": {"train_policy": {"epsilon_low": 0.1}}})
    sft = config_from_dict({"train": {"train_policy": {"conversation_column_name": "msgs"}}})
    assert isinstance(rl.train.train_policy, GrpoConfig)
    assert isinstance(sft.train.train_policy, SftConfig)


def test_zero_dp_shard_size_rejected():
    with pytest.raises(ConfigError, match=r"policy\.parallelism\.dp_shard_size"):
        config_from_dict({"policy": {"parallelism": {"dp_shard_size": 0}}})


def test_aipo_rho_defaults_to_the_variants_value_and_none_is_refused():
    cfg = config_from_dict({"train": {"train_policy": {"type": "grpo", "variant": "aipo"}}})
    assert cfg.grpo.aipo_rho == 2.0
    with pytest.raises(ConfigError, match="aipo_rho"):
        config_from_dict(
            {"train": {"train_policy": {"type": "grpo", "variant": "aipo", "aipo_rho": None}}}
        )


def test_on_policy_requires_sync_every_step_and_sets_zero_staleness():
    cfg = config_from_dict(
        {
            "train": {
                "train_policy": {"type": "grpo", "on_policy": True, "allowed_outdated_steps": 3}
            }
        }
    )
    assert cfg.grpo.allowed_outdated_steps == 0
    assert any("allowed_outdated_steps = 0" in w for w in cfg.warnings)
    with pytest.raises(ConfigError, match="sync_weight_interval"):
        config_from_dict(
            {
                "train": {
                    "sync_weight_interval": 2,
                    "train_policy": {"type": "grpo", "on_policy": True},
                }
            }
        )


def test_every_field_is_documented():
    from pydantic import BaseModel

    from nebula_rl.config import Config

    seen, todo, undocumented = set(), [Config], []
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            if not field.description:
                undocumented.append(f"{model.__name__}.{name}")
            for arg in getattr(field.annotation, "__args__", ()) + (field.annotation,):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
    assert len(seen) > 10
    assert undocumented == []


def test_language_models_run_colocated_separated_and_colocated():
    """(tests/test_colocated.py checks colocated mode's own rules.)"""
    for mode in ("colocated_separated", "colocated"):
        assert config_from_dict({"mode": mode, "rollout": {"backend": "torch"}}).mode == mode


def test_flashinfer_keys_need_the_vllm_backend():
    """FlashInfer is vLLM's (on CUDA): with nebula-rl's torch engine both keys are refused by
    name; with `backend = "vllm"` the config takes them (the engine refuses them on a CPU)."""
    for rollout, key in (
        ({"vllm_use_flashinfer": True}, "rollout.vllm_use_flashinfer"),
        ({"sampling_config": {"use_flashinfer": True}}, "rollout.sampling_config.use_flashinfer"),
    ):
        with pytest.raises(ConfigError, match=rf"{re.escape(key)} = true: FlashInfer kernels"):
            config_from_dict({"rollout": {"backend": "torch", **rollout}})
        config_from_dict({"rollout": {"backend": "vllm", **rollout}})


def test_fp8_rollout_weights_need_the_torch_engine():
    """`rollout.quantization = "fp8"` runs in the built-in engine; with vLLM it is refused by
    key where the config is read, saying why."""
    config_from_dict({"rollout": {"backend": "torch", "quantization": "fp8"}})
    with pytest.raises(ConfigError, match=r'rollout\.quantization = "fp8" with rollout\.backend'
                       r' = "vllm".*no FP8 kernels'):  # fmt: skip
        config_from_dict({"rollout": {"backend": "vllm", "quantization": "fp8"}})
