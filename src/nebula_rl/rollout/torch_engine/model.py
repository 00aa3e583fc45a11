"""What the engine reads of a Hugging Face model: its sizes, decoder layers and head, whether
the compact forward can run it, and whether it can run in FP8."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nebula_rl.models import check_fp8_gpu
from nebula_rl.rollout.multimodal import (
    language_model,
)

FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_5_vl_text", "qwen3_vl_text")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class _ModelDims:
    """The config values the engine needs, read once: HF configs set their attributes per
    architecture at runtime, so this is the one place that reads them untyped."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None

    @classmethod
    def of(cls, model: torch.nn.Module) -> _ModelDims:
        config: Any = model.config
        cfg = config.get_text_config()  # (a vision-language model's language model)
        num_heads = int(cfg.num_attention_heads)
        max_positions = getattr(cfg, "max_position_embeddings", None)
        return cls(
            model_type=str(cfg.model_type),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads),
            max_position_embeddings=None if max_positions is None else int(max_positions),
        )


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """The decoder stack (embeddings, layers, norm, rotary embedding; a vision-language model's
    language model) and its decoder layers."""
    base = language_model(model)
    layers = base.get_submodule("layers")
    assert isinstance(layers, torch.nn.ModuleList)
    return base, layers


def _lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """The model's output projection (HF `get_output_embeddings`)."""
    get_output_embeddings: Any = model.get_output_embeddings  # an HF method, not a submodule
    head = get_output_embeddings()
    assert isinstance(head, torch.nn.Module), "the model has no output embeddings (lm head)"
    return head


def fused_forward_unsupported(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why the compact forward cannot run `model` (None if it can)."""
    config: Any = model.config
    cfg = config.get_text_config()
    if cfg.model_type not in FUSED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {FUSED_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not 'silu'"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in _STATIC_ROPE_TYPES:
        return f"rope_type {rope.get('rope_type')!r} is not one of {_STATIC_ROPE_TYPES}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "sliding-window layers"
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type == "mistral" and window is not None and window < max_model_len:
        return f"sliding_window {window} < max_model_len {max_model_len}"
    # Wrapped or quantized projections (LoRA, bitsandbytes, ...) run through their own modules.
    for layer in _decoder_layers(model)[1]:
        for group, names in (("self_attn", _ATTN_PROJECTIONS), ("mlp", _MLP_PROJECTIONS)):
            modules = [layer.get_submodule(f"{group}.{name}") for name in names]
            if not all(type(m) is torch.nn.Linear for m in modules):
                return f"{group} projections are not plain nn.Linear"
            if len({m.bias is None for m in modules[:-1]}) > 1:
                return f"{group} projections mix biased and unbiased layers"
    return None


def _check_fp8(
    model: torch.nn.Module, device: torch.device, forward: str, reason: str | None
) -> None:
    """Refuse, naming `rollout.quantization`, an FP8 engine this model or device cannot run."""
    key = 'rollout.quantization = "fp8"'
    if forward != "fused":
        raise ValueError(
            f"{key} needs the engine's compact forward (Llama-family models: "
            f"{', '.join(FUSED_MODEL_TYPES)}): {reason or 'forward=hf was asked for'}"
        )
    check_fp8_gpu(device, key)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{key} runs on CUDA GPUs (and, slowly, CPUs), not on {device.type}")
    for layer in _decoder_layers(model)[1]:
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear) and any(n % 16 for n in module.weight.shape):
                raise ValueError(
                    f"{key}: FP8 matmuls need feature sizes divisible by 16; {name} is "
                    f"{tuple(module.weight.shape)}"
                )
