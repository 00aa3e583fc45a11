"""LoRA adapters on a flow model through peft (`policy.lora`, as cosmos-rl's world-model configs
write it): adapters injected into the named modules of the built-in DiT or a diffusers
transformer, only their weights trained.

In the runtime the policy and every rollout replica inject the same adapter into the same
model, so the weight group pushes the frozen base weights once and the adapter's weights after
every step (`ShardedSender` pushes frozen tensors only on a group's first push). An export holds
the merged weights (a model loadable as `policy.model_name_or_path`, LoRA folded in) and, under
`adapter/`, the adapter alone as peft saves it (`adapter_config.json`,
`adapter_model.safetensors`).

`lora_path` starts the adapter from a saved one: an export's `adapter/`, or any peft adapter
folder of the same `r`, `lora_alpha`, `use_rslora` and modules.

`lora_names` is one adapter (cosmos-rl's DiffusionNFT configs name a second, `"old"`, for the
old policy, which nebula-rl keeps as a copy of the whole model instead: accepted with
`trainer_type = "diffusion_nft"`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

from nebula_rl.config import LoraConfig
from nebula_rl.models.lora import load_adapter

__all__ = ["apply_lora", "lora_adapter_state", "merged_copy", "save_adapter"]

KEY = "policy.lora"


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ValueError(f"{KEY}: LoRA needs peft: pip install 'nebula-rl[wfm]'") from err
    return peft


def _peft_config(lora: LoraConfig) -> Any:
    target = lora.target_modules
    if target is None:
        raise ValueError(
            f"{KEY}.target_modules: name the modules to adapt (a list of module-name suffixes, "
            'e.g. ["qkv", "proj"] for the built-in DiT, ["to_q", "to_k", "to_v", "to_out.0"] for '
            'a diffusers transformer) or "all-linear"'
        )
    return _peft().LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=target,
        use_rslora=lora.use_rslora,
        modules_to_save=lora.modules_to_save,
        alpha_pattern=lora.alpha_pattern or {},
        rank_pattern=lora.r_pattern or {},
        init_lora_weights=lora.init_lora_weights,
    )


def apply_lora(model: nn.Module, lora: LoraConfig, *, trainer_type: str) -> nn.Module:
    """Inject `lora`'s adapter into `model` in place and freeze everything else, then load
    `lora_path`'s adapter into it when given (a folder as an export's `adapter/` or peft saves
    one); `model`."""
    names = lora.lora_names
    if len(names) != 1 and not (trainer_type == "diffusion_nft" and names == ["default", "old"]):
        raise ValueError(
            f"{KEY}.lora_names = {names}: a world model trains one adapter (DiffusionNFT's "
            '["default", "old"] is accepted: its old policy is a copy of the whole model)'
        )
    config = _peft_config(lora)
    try:
        _peft().inject_adapter_in_model(config, model, adapter_name=names[0])
    except ValueError as err:  # e.g. target modules that match nothing
        raise ValueError(f"{KEY}.target_modules = {lora.target_modules!r}: {err}") from err
    trainable = [f"lora_{part}.{names[0]}." for part in ("A", "B")]
    saved = lora.modules_to_save or []
    for name, param in model.named_parameters():
        param.requires_grad = any(t in name for t in trainable) or any(
            f".modules_to_save.{names[0]}." in name and s in name for s in saved
        )
    model._nebula_lora = (config, names[0])  # type: ignore[assignment]
    if lora.lora_path is not None:
        load_adapter(model, Path(lora.lora_path), lora, names[0])
    return model


def lora_adapter_state(model: nn.Module) -> tuple[Any, str] | None:
    """(peft config, adapter name) of a model `apply_lora` adapted; None for any other."""
    return getattr(model, "_nebula_lora", None)


def merged_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with its adapter folded into the base weights and the LoRA layers
    replaced by their base layers (the architecture before `apply_lora`)."""
    from peft.tuners.lora import LoraLayer

    merged = copy.deepcopy(model)
    for name, module in list(merged.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = merged.get_submodule(parent_name) if parent_name else merged
            setattr(parent, child, module.get_base_layer())
    if hasattr(merged, "_nebula_lora"):
        del merged._nebula_lora
    return merged


def save_adapter(model: nn.Module, folder: Path) -> None:
    """The adapter of `model` as peft saves one (`adapter_config.json`,
    `adapter_model.safetensors`)."""
    from safetensors.torch import save_file

    peft = _peft()
    found = lora_adapter_state(model)
    assert found is not None
    config, name = found
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    state = peft.get_peft_model_state_dict(model, adapter_name=name)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in state.items()},
        str(folder / "adapter_model.safetensors"),
    )
