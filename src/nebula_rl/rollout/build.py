"""The engine `[rollout] backend` names, built from the config (one place for both loops).

`rollout.backend = "torch"` is nebula-rl's built-in engine on the model the caller loaded
(`enable_chunked_prefill` and `max_num_batched_tokens` apply to it too);
`"example_hf"` (cosmos-rl's engine for `mode = "colocated"`) is the torch engine in that mode;
`"vllm"` (the default, as in cosmos-rl) is vLLM, which loads the model folder itself and takes
cosmos-rl's vLLM settings (`gpu_memory_utilization`, `enforce_eager`, `enable_chunked_prefill`).
:func:`check_backend` tells, before any process starts or model loads, whether the backend can
run here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from nebula_rl.config import Config
from nebula_rl.rollout.engine import Engine
from nebula_rl.rollout.multimodal import is_multimodal
from nebula_rl.rollout.tensor_parallel import TensorParallel

__all__ = ["build_engine", "check_backend", "max_model_len"]


def check_backend(cfg: Config) -> None:
    """Raise ValueError naming `rollout.backend` when its engine cannot run on this machine."""
    if cfg.rollout.backend != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            'rollout.backend = "vllm" (the default, as in cosmos-rl) needs the vllm package, '
            "which is not installed here: `pip install vllm` on a CUDA machine, or set "
            'rollout.backend = "torch" for nebula-rl\'s built-in engine (CPU and CUDA)'
        )
    if not torch.cuda.is_available():
        raise ValueError(
            'rollout.backend = "vllm" needs a CUDA device, and none is visible; set '
            'rollout.backend = "torch" to generate on this machine'
        )


def max_model_len(cfg: Config, model_config: Any) -> int:
    """Longest prompt + completion: `policy.model_max_length`, capped by the model's positions."""
    limit = getattr(model_config, "max_position_embeddings", None)
    return min(cfg.policy.model_max_length, limit) if limit else cfg.policy.model_max_length


def build_engine(
    cfg: Config,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    seed: int,
    model_path: str | None = None,
    tensor_parallel: TensorParallel | None = None,
) -> Engine:
    """The configured engine over `model` (torch) or over the model folder `model_path` (vLLM,
    which loads the weights itself; later weights arrive through `update_weights`)."""
    r = cfg.rollout
    if r.backend == "vllm" and is_multimodal(model):
        raise ValueError(
            'rollout.backend = "vllm": vision-language prompts are not passed to vLLM yet (its '
            'multi_modal_data); set rollout.backend = "torch", whose engine generates from '
            "images and videos"
        )
    if r.backend == "vllm" and r.multi_turn_config.enable:
        raise ValueError(
            'rollout.multi_turn_config.enable with rollout.backend = "vllm": multi-turn '
            "rollouts keep each conversation's KV cache across turns in nebula-rl's own engine; "
            'set rollout.backend = "torch"'
        )
    check_backend(cfg)
    if r.backend == "vllm" and r.quantization != "none":
        raise ValueError(
            f'rollout.quantization = "{r.quantization}" with rollout.backend = "vllm": weight '
            "updates into vLLM's quantized layers are not built; use rollout.backend = "
            '"torch", whose engine runs FP8 weights and quantizes each update'
        )
    # (cosmos-rl's example_hf backend runs the policy's own module in colocated mode: here the
    # torch engine over the policy's weights)
    if r.backend == "torch" or (r.backend == "example_hf" and cfg.mode == "colocated"):
        from nebula_rl.rollout.lockstep import LockstepEngine
        from nebula_rl.rollout.torch_engine import TorchEngine

        kwargs: dict[str, Any] = dict(
            max_num_seqs=r.max_num_seqs,
            max_model_len=max_model_len(cfg, model.config),  # type: ignore[union-attr]
            max_num_batched_tokens=r.max_num_batched_tokens,
            chunked_prefill=r.enable_chunked_prefill,
            tokenizer=tokenizer,
            seed=seed,
            forward="hf" if cfg.train.force_use_hf else "auto",
            quantization=r.quantization,
        )
        if tensor_parallel is not None and tensor_parallel.size > 1:
            # (the ranks of a tensor-parallel replica step together, led by rank 0)
            return LockstepEngine(model, tensor_parallel=tensor_parallel, **kwargs)
        return TorchEngine(model, **kwargs)
    from nebula_rl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_path or cfg.policy.model_name_or_path,
        dtype=cfg.train.param_dtype,
        max_model_len=max_model_len(cfg, model.config),  # type: ignore[union-attr]
        seed=seed,
        gpu_memory_utilization=r.gpu_memory_utilization,
        enforce_eager=r.enforce_eager,
        enable_chunked_prefill=r.enable_chunked_prefill,
        max_num_batched_tokens=r.max_num_batched_tokens,
        max_num_seqs=r.max_num_seqs,
        tensor_parallel_size=r.parallelism.tp_size,
        pipeline_parallel_size=r.parallelism.pp_size,
    )
