"""Tensor (and sequence) parallelism of the decoder: the TP plans of the Llama, Qwen2 and
Qwen3 families and of the language models of Qwen2.5-VL, Qwen3-VL and Cosmos 3 Edge, and
`apply_tp`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nebula_rl.policy.parallelize.structure import (
    decoder_layers,
    decoder_stack,
    model_config,
    tied_embeddings,
    vision_blocks,
)

# Tensor parallel


def _decoder_tp_plan() -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """Megatron-style TP with sequence parallel for Llama-like HF decoders: (root plan, layer plan).

    The residual stream stays a DTensor sharded on the sequence (`use_local_output=False`), so HF
    code that reads its shape (positions, masks) sees the full sequence length; attention and MLP
    inputs are all-gathered, and their outputs reduce-scattered back onto the sequence. q/k/v are
    sharded by heads: HF views them with `-1` heads, so each rank runs its local heads as is.
    """
    root: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
        ),
    }
    layer: dict[str, ParallelStyle] = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    return root, layer


def _qwen3_tp_plan() -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """Qwen3 adds an RMSNorm over each head of q and k, [b, l, heads, head_dim]: its input is
    sharded by heads (dim 2), so each rank's gradient of the shared weight is partial; as a
    replicated DTensor the weight gets the sum."""
    root, layer = _decoder_tp_plan()
    for name in ("self_attn.q_norm", "self_attn.k_norm"):
        layer[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return root, layer


def _squared_relu_tp_plan() -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """A decoder whose MLP is `fc2(act(fc1(x)))` (Cosmos 3 Edge's language model): fc1 split by
    columns, fc2 by rows, as gate/up and down are."""
    root, layer = _decoder_tp_plan()
    for name in ("gate_proj", "up_proj", "down_proj"):
        del layer[f"mlp.{name}"]
    layer["mlp.fc1"] = ColwiseParallel()
    layer["mlp.fc2"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return root, layer


TP_PLANS: dict[str, Callable[[], tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]]] = {
    "llama": _decoder_tp_plan,
    "qwen2": _decoder_tp_plan,
    "qwen3": _qwen3_tp_plan,
    "qwen2_5_vl_text": _decoder_tp_plan,  # Qwen2.5-VL's language model
    "qwen3_vl_text": _qwen3_tp_plan,  # Qwen3-VL's
    "cosmos3_edge_text": _squared_relu_tp_plan,  # Cosmos 3 Edge's
}
"""HF `model_type` (a vision-language model's: its text config's) -> its TP plan (module names
as in Hugging Face's implementation)."""


def _vision_language_tp_plan(
    model: nn.Module,
) -> tuple[dict[str, ParallelStyle], list[ParallelStyle]]:
    """The TP plan of a vision-language model's language model beyond the text plan's layer
    plan: (root plan, each decoder layer's own input/output style). Its forward writes the
    vision embeddings into the token embeddings (`masked_scatter`) and, in Qwen3-VL, adds
    DeepStack features to the outputs of the first layers (boolean indexing): both are
    plain-tensor code. So the embedding gives a replicated plain tensor; each layer takes its
    input as it comes (replicated or already sharded) and shards it on the sequence, where the
    text plan's layers start; a DeepStack layer gives its output back replicated. The vision
    tower is not split: `parallelize_model` shards it with FSDP2 over the TP ranks too."""
    decoder = "model.language_model"
    root: dict[str, ParallelStyle] = {
        f"{decoder}.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True
        ),
        f"{decoder}.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
        ),
    }
    into_layer = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
    )
    through_layer = PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(Shard(1),),
        use_local_input=False,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Replicate(),),
        use_local_output=True,
    )
    deepstack = len(
        getattr(model_config(model).vision_config, "deepstack_visual_indexes", None) or []
    )
    layers = len(decoder_layers(model))
    return root, [through_layer if i < deepstack else into_layer for i in range(layers)]


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard `model` (an HF causal LM or a pipeline stage of one, or a vision-language model's
    language model) over `tp_mesh`, in place."""
    root, layer_plan = TP_PLANS[model_config(model).get_text_config().model_type]()
    decoder = decoder_stack(model)
    layers = list(decoder.layers.children())
    own: list[ParallelStyle | None] = [None] * len(layers)  # a layer's own inputs and outputs
    if vision_blocks(model):
        root, vision_own = _vision_language_tp_plan(model)
        own = list(vision_own)
    # A pipeline stage lacks the embedding or the head; plan only what it holds.
    present = {name: style for name, style in root.items() if _has(model, name)}
    parallelize_module(model, tp_mesh, present)
    for layer, style in zip(layers, own, strict=True):
        if style is not None:
            parallelize_module(layer, tp_mesh, style)
        parallelize_module(layer, tp_mesh, layer_plan)
    # Both sides of a tied embedding are sharded on the vocabulary (Shard(0) of [V, H]), so one
    # DTensor serves both; parallelize_module made two, re-tie them.
    if tied_embeddings(model) and _has(model, "lm_head") and getattr(decoder, "embed_tokens", None):
        head: Any = model.lm_head
        head.weight = decoder.embed_tokens.weight


def _has(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False
