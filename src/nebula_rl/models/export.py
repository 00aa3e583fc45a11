"""Hugging Face exports of a trained model (safetensors, config, tokenizer); of a LoRA policy,
the merged model and, under `adapter/`, the adapter as peft saves it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nebula_rl.models.lora import full_merged_state, has_lora, save_adapter

__all__ = ["Staged", "export_hf"]


class Staged(Protocol):
    """A model split over ranks as the policy splits it (`policy.parallelize.ParallelModel`):
    its sizes per parallelism (`dims.pp`, the pipeline stages) and every parameter gathered
    whole from the ranks that hold it."""

    dims: Any

    def full_named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def export_hf(
    model: torch.nn.Module, tokenizer: Any, path: Path, *, parallel: Staged | None = None
) -> None:
    """Write a Hugging Face folder (config, safetensors, tokenizer) that `from_pretrained` loads.

    Under torch.distributed every rank must call it (sharded parameters are gathered); rank 0
    writes. Under pipeline parallelism `model` (the HF model the stages were split from) gives
    the config and `parallel` the weights, gathered from every stage.

    A model with a LoRA adapter (`nebula_rl.models.lora`) is written merged, under the plain
    names (a folder `AutoModelForCausalLM` loads), with the adapter alone in `path/adapter`
    (`PeftModel.from_pretrained` loads it on the base model)."""
    state: dict[str, Any] | None = None
    if parallel is not None and parallel.dims.pp > 1:
        lead = dist.get_rank() == 0
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {
            name: tensor.cpu().clone()
            for name, tensor in parallel.full_named_parameters()
            # (save_pretrained keeps one name of a tied embedding)
            if lead and not (tied and name == "lm_head.weight")
        }
        if not lead:
            dist.barrier()
            return
    elif dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(model, options=options)
        # Tied weights appear under both names; keep the one save_pretrained keeps by itself.
        unique = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        state = {k: v for k, v in full.items() if k in unique}
        if dist.get_rank() != 0:
            dist.barrier()
            return
    path.mkdir(parents=True, exist_ok=True)
    if has_lora(model):
        if state is None:  # (one process: each tied tensor once, as save_pretrained keeps it)
            unique = {n for n, _ in model.named_parameters()}
            unique |= {n for n, _ in model.named_buffers()}
            state = {k: v for k, v in model.state_dict().items() if k in unique}
        save_adapter(model, state, path / "adapter")
        state = full_merged_state(model, state)
    model.save_pretrained(path, state_dict=state, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
