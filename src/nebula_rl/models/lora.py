"""LoRA adapters on a language-model policy through peft (`policy.lora`, cosmos-rl's keys).

`apply_lora` injects one adapter into the Hugging Face model in place
(`peft.inject_adapter_in_model`: the model keeps its class and its module tree, so the repo's
own `parallelize_model` still finds its decoder layers and splits them, FSDP2 included), freezes
everything but the adapter's A/B matrices and `modules_to_save`, and loads `lora_path`'s
adapter when one is given. The optimiser then holds the adapter alone (`build_optimizer` takes
trainable parameters only), and checkpoints save only what trains (`Checkpointer`'s
`trainable_only`).

The rollout engine never sees peft. A weight push carries the adapter, not merged weights
(`adapter_parameters`): per adapted linear module `<m>` (its plain name), `<m>.lora_A.weight`
[r, in] and `<m>.lora_B.weight` [out, r] with the scale folded into B (trainable: every push
carries them), the frozen base weight as `<m>.base_layer.weight` (on a group's first push only,
like every frozen tensor), and every other parameter under its plain Hugging Face name
(`modules_to_save` copies trainable). The rollout keeps the base it received (one extra copy
of the adapted weights) and, at the token boundary after each push, writes W = W0 + B @ A into
its engine's weights in place (`nebula_rl.rollout.lora_merge`). So a push after a step moves
r (in + out) numbers per adapted layer instead of in x out (the demo's model: 0.59 MB instead
of 11.6 MB, see docs/lora.md). The base goes over the wire once rather than being read
from the rollout's own checkpoint because it need not be that checkpoint: `pissa` and `olora`
initialisation replace it with the residual of their decomposition.

`merged_parameters` gives the merged weights under the plain names (W + scale * B @ A, computed
into new tensors: the policy is not modified, so nothing has to be unmerged), for an engine in
the policy's own process, which copies them in place and pushes nothing: `--local` runs and
colocated replicas (`policy.setup.rollout_weights`).

Under FSDP2 the pushed tensors stay DTensors with their placements (each rank pushes its own
rows of A, B and the base). For the merged weights the base weight and B are sharded by rows
alike and A is gathered by the DTensor matmul (it is r x in_features), so each rank computes
its own rows.

`full_merged_state` and `adapter_state` give the export's two forms: the merged model (a plain
Hugging Face folder) and the adapter as peft saves it (`adapter_config.json`,
`adapter_model.safetensors`, keys `base_model.model.<module>.lora_A.weight`), which
`PeftModel.from_pretrained` loads on the base model.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from nebula_rl.config import LoraConfig, PolicyConfig

__all__ = [
    "KEY",
    "adapted_modules",
    "adapter_name",
    "adapter_parameters",
    "adapter_state",
    "apply_lora",
    "full_merged_state",
    "has_lora",
    "load_adapter",
    "merged_parameters",
    "plain_copy",
    "plain_name",
    "save_adapter",
]

KEY = "policy.lora"
_PEFT_PREFIX = "base_model.model."  # (the prefix PeftModel's own state dict gives every key)


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ValueError(f"{KEY}: LoRA needs peft: pip install peft") from err
    return peft


def _peft_config(lora: LoraConfig, base: str) -> Any:
    if lora.target_modules is None:
        raise ValueError(
            f"{KEY}.target_modules: name the linear layers to adapt (module-name suffixes, e.g. "
            '["q_proj", "k_proj", "v_proj", "o_proj"]) or "all-linear"'
        )
    return _peft().LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora.target_modules,
        use_rslora=lora.use_rslora,
        modules_to_save=lora.modules_to_save,
        alpha_pattern=lora.alpha_pattern or {},
        rank_pattern=lora.r_pattern or {},
        init_lora_weights=lora.init_lora_weights,
        base_model_name_or_path=base,
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, policy: PolicyConfig) -> nn.Module:
    """Inject `policy.lora`'s adapter into `model` in place, train only it (and
    `modules_to_save`), and load `lora_path` into it when given; `model`."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    lora = policy.lora
    assert lora is not None
    name = lora.lora_names[0]
    config = _peft_config(lora, policy.model_name_or_path)
    # (read before injecting: a module_to_save replaces the module get_input_embeddings finds)
    embedding = model.get_input_embeddings().weight  # type: ignore[operator]
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    try:
        _peft().inject_adapter_in_model(config, model, adapter_name=name)
    except ValueError as err:  # e.g. target modules that match nothing
        raise ValueError(f"{KEY}.target_modules = {lora.target_modules!r}: {err}") from err
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            kind = type(module.get_base_layer()).__name__
            raise ValueError(
                f"{KEY}.target_modules: {module_name} is a {kind}; LoRA adapts linear layers "
                "only here"
            )
        base = getattr(module, "original_module", None) or (
            module.get_base_layer() if isinstance(module, LoraLayer) else None
        )
        if tied and base is not None and getattr(base, "weight", None) is embedding:
            raise ValueError(
                f"{KEY}: {module_name} shares its weight with the output head "
                "(tie_word_embeddings), so adapting or training it alone would untie them; "
                "leave it out of target_modules and modules_to_save"
            )
    trainable = (f".lora_A.{name}.", f".lora_B.{name}.", f".modules_to_save.{name}.")
    for param_name, param in model.named_parameters():
        param.requires_grad_(any(t in param_name for t in trainable))
    model._nebula_lora = (config, name)  # type: ignore[assignment]
    if lora.lora_path is not None:
        load_adapter(model, Path(lora.lora_path), lora, name)
    return model


def load_adapter(model: nn.Module, folder: Path, lora: LoraConfig, name: str) -> None:
    """Load a saved adapter folder (as `save_adapter` or peft writes one) into `model`, whose
    adapter `name` was injected from `lora` (its `r`, `lora_alpha` and `use_rslora` must match
    the folder's)."""
    peft = _peft()
    key = f"{KEY}.lora_path"
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{key} = {str(folder)!r}: no adapter_config.json there")
    saved = json.loads(config_file.read_text())
    for field, want in (("r", lora.r), ("lora_alpha", lora.lora_alpha)):
        if field in saved and saved[field] != want:
            raise ValueError(
                f"{key}: the adapter was trained with {field} = {saved[field]}, "
                f"{KEY}.{field} is {want}; make them equal"
            )
    if saved.get("use_rslora", False) != lora.use_rslora:
        raise ValueError(
            f"{key}: the adapter's use_rslora is {saved.get('use_rslora', False)}, "
            f"{KEY}.use_rslora is {lora.use_rslora}; make them equal"
        )
    weights = peft.utils.load_peft_weights(str(folder), device="cpu")
    weights = {k.removeprefix(_PEFT_PREFIX): v for k, v in weights.items()}
    try:
        result = peft.set_peft_model_state_dict(model, weights, adapter_name=name)
    except RuntimeError as err:  # (shapes: another rank or other layers)
        raise ValueError(f"{key}: the adapter does not fit {KEY}: {err}") from err
    unexpected = [k for k in result.unexpected_keys if "lora_" in k or "modules_to_save" in k]
    missing = [k for k in result.missing_keys if f".{name}." in k]
    if unexpected or missing:
        raise ValueError(
            f"{key}: the adapter's modules differ from those {KEY}.target_modules and "
            f"modules_to_save name (it has {unexpected[:2]} too, lacks {missing[:2]})"
        )


def has_lora(model: nn.Module) -> bool:
    """Whether `apply_lora` adapted `model`."""
    return hasattr(model, "_nebula_lora")


def adapter_name(model: nn.Module) -> str:
    """The name of the adapter `apply_lora` injected into `model`."""
    return str(_lora_state(model)[1])


def _lora_state(model: nn.Module) -> tuple[Any, str]:
    """(peft LoraConfig, adapter name) that `apply_lora` recorded on `model`."""
    state: tuple[Any, str] = model.__dict__["_nebula_lora"]
    return state


def plain_name(name: str) -> str | None:
    """The Hugging Face name of a parameter of an adapted model (`q_proj.base_layer.weight`
    -> `q_proj.weight`, a `modules_to_save` copy -> the module's own name); None for the
    adapter's matrices and the replaced originals of `modules_to_save`."""
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        del parts[i : i + 2]  # (and the adapter's name)
    return ".".join(p for p in parts if p != "base_layer")


def _scalings(model: nn.Module) -> dict[str, float]:
    """Module name -> scale (alpha / r, or alpha / sqrt(r) with rslora, per module with the
    patterns) of every adapted layer."""
    from peft.tuners.lora import LoraLayer

    name = adapter_name(model)
    return {n: m.scaling[name] for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _merge(
    named: Iterable[tuple[str, Tensor]], scalings: Mapping[str, float], adapter: str
) -> dict[str, Tensor]:
    """Plain names -> tensors, each adapted weight merged (W + scale * B @ A); DTensors stay
    DTensors with the base weight's placements."""
    tensors = dict(named)
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        plain = plain_name(name)
        if plain is None:
            continue
        module = name.removesuffix(".base_layer.weight")
        if module != name and module in scalings:
            a = tensors[f"{module}.lora_A.{adapter}.weight"]
            b = tensors[f"{module}.lora_B.{adapter}.weight"]
            delta = (b.to(torch.float32) @ a.to(torch.float32)) * scalings[module]
            merged = tensor + delta.to(tensor.dtype)
            if isinstance(tensor, DTensor):
                assert isinstance(merged, DTensor)
                merged = merged.redistribute(tensor.device_mesh, tensor.placements)
            tensor = merged
        out[plain] = tensor
    return out


def merged_parameters(model: nn.Module) -> dict[str, Tensor]:
    """This rank's weights of the adapted `model` under the plain Hugging Face names, adapted
    weights merged into new tensors (marked `requires_grad`: they change with every step, so
    every weight push carries them); the other parameters as they are. All ranks of a sharded
    model call it together (the merge gathers each A)."""
    with torch.no_grad():
        merged = _merge(model.named_parameters(), _scalings(model), adapter_name(model))
    adapted = {plain_name(f"{m}.base_layer.weight") for m in _scalings(model)}
    for name in adapted:
        assert name is not None
        merged[name].requires_grad_(True)
    return merged


def adapter_parameters(model: nn.Module) -> dict[str, Tensor]:
    """This rank's tensors of the adapted `model` as a weight push sends them (see the module
    docstring): per adapted module `<m>`, `<m>.lora_A.weight`, `<m>.lora_B.weight` with the
    scale folded in (a new tensor each call, marked `requires_grad`: it changes with every
    step) and the frozen `<m>.base_layer.weight`; every other parameter under its plain name, as
    it is. DTensors stay DTensors with their placements; no collective."""
    scalings, adapter = _scalings(model), adapter_name(model)
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            module, _, rest = name.partition(".lora_")
            if rest:  # (`A.<adapter>.weight` or `B.<adapter>.weight`)
                matrix = rest.split(".")[0]
                assert rest == f"{matrix}.{adapter}.weight", name
                key = f"{module}.lora_{matrix}.weight"
                if matrix == "B":
                    out[key] = (param * scalings[module]).requires_grad_(True)
                else:
                    out[key] = param
            elif name.removesuffix(".base_layer.weight") in scalings:
                out[name] = param
            elif (plain := plain_name(name)) is not None:
                out[plain] = param
    return out


def adapted_modules(model: nn.Module, lora: LoraConfig) -> dict[str, int]:
    """Module name -> rank of every linear layer that `lora` adapts in a model of `model`'s
    class and config (a plain one: a rollout engine's), found as `apply_lora` finds them: peft
    injects the adapter into a meta-device copy of the architecture (no weights, no
    initialisation), so target_modules, "all-linear" and the patterns mean exactly what they
    mean on the policy."""
    from peft.tuners.lora import LoraLayer

    config = _peft_config(lora, "")
    config.init_lora_weights = False  # (pissa/olora would decompose weights a skeleton lacks)
    name = lora.lora_names[0]
    with torch.device("meta"):
        skeleton = type(model)(copy.deepcopy(model.config))
    _peft().inject_adapter_in_model(config, skeleton, adapter_name=name)
    return {
        module_name: int(module.r[name])
        for module_name, module in skeleton.named_modules()
        if isinstance(module, LoraLayer)
    }


def plain_copy(model: nn.Module) -> nn.Module:
    """A copy of the adapted (unsharded) `model` without peft: each adapted layer its base layer
    with the adapter merged in, each `modules_to_save` wrapper its trained copy."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    name = adapter_name(model)
    plain = copy.deepcopy(model)
    for module_name, module in list(plain.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(adapter_names=[name])
            replacement = module.get_base_layer()
        elif isinstance(module, ModulesToSaveWrapper):
            replacement = module.modules_to_save[name]
        else:
            continue
        parent_name, _, child = module_name.rpartition(".")
        setattr(plain.get_submodule(parent_name) if parent_name else plain, child, replacement)
    for attr in ("_nebula_lora", "peft_config"):
        if hasattr(plain, attr):
            delattr(plain, attr)
    return plain


def full_merged_state(model: nn.Module, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The merged weights under plain names from `full`, the adapted model's full (gathered)
    state dict: what `save_pretrained` writes as the export's model."""
    with torch.no_grad():
        return _merge(full.items(), _scalings(model), adapter_name(model))


def adapter_state(model: nn.Module, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapter's tensors from `full` (the adapted model's full state dict) under the keys
    peft's `PeftModel.save_pretrained` writes."""
    peft = _peft()
    state = peft.get_peft_model_state_dict(
        model,
        state_dict=dict(full),
        adapter_name=adapter_name(model),
        save_embedding_layers=False,  # (only what the adapter trains: A, B, modules_to_save)
    )
    return {_PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in state.items()}


def save_adapter(model: nn.Module, full: Mapping[str, Tensor], folder: Path) -> None:
    """Write the adapter of `model` (from its full state dict `full`) as peft saves one:
    `adapter_config.json` and `adapter_model.safetensors`."""
    from safetensors.torch import save_file

    config, _ = _lora_state(model)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    save_file(adapter_state(model, full), str(folder / "adapter_model.safetensors"))
