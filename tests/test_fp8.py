"""FP8: the engine's FP8 rollout weights (`rollout.quantization = "fp8"`) and the refusals of FP8
training (`train.fp8`) where it cannot run. The GPU checks (FP8 training against bf16, FP8
log-probs against the bf16 policy) are in tests/test_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from nebula_rl.config import ConfigError, config_from_dict
from nebula_rl.models import load_model
from nebula_rl.policy.setup import apply_fp8
from nebula_rl.rollout.build import build_engine
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.rollout.torch_engine.layers import (
    _apply,
    _Linear,
    _quantize_rows,
    _quantized,
)
from test_engine import make_prompts, tiny_model


def test_fp8_matmul_is_the_product_of_its_quantized_operands() -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 5, 256), torch.randn(512, 256) * 0.1, torch.randn(512)
    linear = _quantized(_Linear(weight, bias))
    assert linear.fp8 is not None and linear.fp8.weight.dtype == torch.float8_e4m3fn
    out = _apply(x, linear)
    assert out.shape == (2, 5, 512) and out.dtype == x.dtype
    rows, scale = _quantize_rows(x.reshape(-1, 256))
    # Every row's largest magnitude lands on e4m3's largest value, 448.
    assert torch.equal(rows.float().abs().amax(-1), torch.full((10,), 448.0))
    dequantized = linear.fp8.weight.float() * linear.fp8.scale.reshape(-1, 1)
    expected = (rows.float() * scale) @ dequantized.t() + bias
    torch.testing.assert_close(out.reshape(-1, 512), expected, rtol=1e-5, atol=1e-5)
    # ...which is the full-precision product to within e4m3's 3 mantissa bits.
    exact = torch.nn.functional.linear(x, weight, bias)
    error = float((out - exact).norm() / exact.norm())
    assert 1e-3 < error < 0.05


def _generate(engine: TorchEngine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    outputs = engine.generate([GenerationRequest(p, sampling=sampling) for p in prompts])
    return [(o.completions[0].token_ids, o.completions[0].logprobs) for o in outputs]


def test_fp8_engine_quantizes_each_weight_update() -> None:
    """After an update the FP8 engine samples exactly as an FP8 engine built on the new weights,
    and unlike one still on the old weights' FP8 copy."""
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    prompts = make_prompts(4)
    engine = TorchEngine(copy.deepcopy(old), max_num_seqs=8, max_model_len=64, quantization="fp8")
    before = _generate(engine, prompts)
    engine.update_weights(new.state_dict(), policy_version=1)
    after = _generate(engine, prompts)
    fresh = TorchEngine(copy.deepcopy(new), max_num_seqs=8, max_model_len=64, quantization="fp8")
    assert after == _generate(fresh, prompts)
    assert after != before
    plain = TorchEngine(copy.deepcopy(new), max_num_seqs=8, max_model_len=64)
    assert _generate(plain, prompts) != after  # (the FP8 path ran: its log-probs differ)


def test_fp8_engine_logprobs_stay_near_the_full_precision_policy() -> None:
    """FP8 rounding moves the log-probs the engine reports away from the policy's own (the
    importance ratio corrects for it in training); on this model by a mean of ~0.02 nats (max ~0.05)."""
    model = tiny_model(initializer_range=0.02)  # (HF's default: a smoother distribution)
    prompts = make_prompts(6)
    engine = TorchEngine(copy.deepcopy(model), max_num_seqs=8, max_model_len=64, quantization="fp8")
    gaps = []
    for prompt, (tokens, logprobs) in zip(prompts, _generate(engine, prompts), strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        policy = logits.float().log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        gaps.append((policy - torch.tensor(logprobs)).abs())
    gap = torch.cat(gaps)
    assert 1e-4 < float(gap.mean()) < 0.1
    assert float(gap.max()) < 0.2


def test_fp8_engine_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match=r'rollout\.quantization = "fp8" needs .*compact forward'):
        TorchEngine(tiny_model("gemma"), max_num_seqs=2, max_model_len=64, quantization="fp8")
    torch.manual_seed(0)
    odd = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=200,  # not a multiple of 16
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=None,
    )
    model = transformers.AutoModelForCausalLM.from_config(odd)
    with pytest.raises(ValueError, match=r"divisible by 16.*mlp\.gate_proj.*\(200, 128\)"):
        TorchEngine(model, max_num_seqs=2, max_model_len=64, quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be"):
        TorchEngine(tiny_model(), max_num_seqs=2, max_model_len=64, quantization="int4")  # type: ignore[arg-type]


def test_rollout_quantization_reaches_the_torch_engine_and_is_refused_for_vllm() -> None:
    cfg = config_from_dict(
        {
            "rollout": {"backend": "torch", "quantization": "fp8"},
            "policy": {"model_name_or_path": "tiny:qwen2"},
        }
    )
    model = load_model("tiny:qwen2", dtype=torch.float32)
    engine = build_engine(cfg, model=model, tokenizer=None, seed=0)
    assert isinstance(engine, TorchEngine) and engine.quantization == "fp8"
    with pytest.raises(
        ConfigError, match=r'rollout\.quantization = "fp8" with rollout\.backend = "vllm"'
    ):
        config_from_dict({"rollout": {"quantization": "fp8"}})
    with pytest.raises(ConfigError, match=r'rollout\.quantization = "mxfp4"'):
        config_from_dict({"rollout": {"backend": "torch", "quantization": "mxfp4"}})


def test_fp8_training_is_refused_without_an_fp8_gpu() -> None:
    cfg = config_from_dict({"train": {"fp8": {"enable_fp8": True, "quant_recipe": "tensorwise"}}})
    model = load_model("tiny:qwen2")
    with pytest.raises(ValueError, match=r"train\.fp8\.enable_fp8 = true needs CUDA GPUs .*on cpu"):
        apply_fp8(model, cfg.train)
    with pytest.raises(ConfigError, match=r"train\.fp8\.fp8_recipe.*delayed scaling was removed"):
        config_from_dict({"train": {"fp8": {"fp8_recipe": "delayed_scaling"}}})
    with pytest.raises(ConfigError, match=r"train\.fp8\.quant_recipe"):
        config_from_dict({"train": {"fp8": {"quant_recipe": "blockwise"}}})
