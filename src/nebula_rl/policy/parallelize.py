"""Policy parallelism: how one policy replica's model is split over its devices.

`ParallelDims` turns `[policy.parallelism]` and the world size into mesh sizes, checks them against
the model and is the one place that builds the DeviceMesh, with axes
("pp", "dp_replicate", "dp_shard", "cp", "tp"). `parallelize_model` applies one `apply_*` per
parallelism in torchtitan's order (see its comments) and returns a :class:`ParallelModel`, whose
`run` / `forward_backward` runs one batch the way the parallelism needs: a plain forward (and
backward), a pipeline schedule (PP: GPipe, 1F1B, or Interleaved1F1B with several stages per
rank), or with each sequence split over the CP ranks (torch's `context_parallel` on CUDA,
`sequence_split.GatheredAttention` elsewhere).

Loss convention (STYLE rule 3): `loss_fn` returns its tokens' *share of the global loss*: a sum
over the tokens it sees divided by a global count that the caller passes in. Shares then add up
exactly, so gradients are summed, never averaged, over the data axes (dp_replicate, dp_shard, cp)
and over pipeline micro-batches, and the result does not depend on how the batch was split.

Simplifications: pipeline stages hold whole decoder layers, in equal numbers; under PP and CP
batches are unpadded or right-padded (the causal mask alone is exact there, so no attention mask
is taken); CP needs SDPA attention and cannot be combined with PP; the TP plan covers
the Llama, Qwen2 and Qwen3 families and the language models of Qwen2.5-VL and Qwen3-VL (whose vision
tower FSDP2 shards over the TP ranks instead: `shard_vision_over_tp`); PP and CP of a
vision-language model are refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import PretrainedConfig

from nebula_rl.config import ParallelismConfig
from nebula_rl.models import media_token_ids
from nebula_rl.sequence_split import GatheredAttention

__all__ = [
    "MESH_AXES",
    "PP_SCHEDULES",
    "TP_PLANS",
    "LossFn",
    "ParallelDims",
    "ParallelModel",
    "apply_ac",
    "apply_compile",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "parallelize_model",
    "pipeline_stage_layers",
    "split_pipeline",
    "split_pipeline_stage",
    "total_grad_norm",
    "whole_model_loss",
]

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Names of the device mesh's axes, outermost first."""

KEY = "policy.parallelism"

LossFn = Callable[[Tensor, Tensor], Tensor]
"""(logits [b, l, V], labels [b, l, ...]) -> this piece's share of the global loss (a scalar)."""


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Sizes of the mesh axes of one policy replica; their product is its world size."""

    pp: int
    """Pipeline stages."""
    dp_replicate: int
    """Replicated data parallel (DDP, or HSDP's outer axis)."""
    dp_shard: int
    """Sharded data parallel (FSDP2, or HSDP's inner axis)."""
    cp: int
    """Context parallel (sequence sharded in attention)."""
    tp: int
    """Tensor parallel, with sequence parallel on the norms."""

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, *, world_size: int) -> ParallelDims:
        """Sizes from `[policy.parallelism]`, with `dp_shard_size = -1` inferred."""
        others = cfg.pp_size * cfg.dp_replicate_size * cfg.cp_size * cfg.tp_size
        dp_shard = cfg.dp_shard_size
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"{KEY}: pp_size * dp_replicate_size * cp_size * tp_size ({others}) must "
                    f"divide the world size ({world_size}) to infer dp_shard_size"
                )
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise ValueError(
                f"{KEY}: pp_size ({cfg.pp_size}) * dp_replicate_size ({cfg.dp_replicate_size}) * "
                f"dp_shard_size ({dp_shard}) * cp_size ({cfg.cp_size}) * tp_size ({cfg.tp_size}) "
                f"= {others * dp_shard} must equal the world size ({world_size})"
            )
        return cls(
            pp=cfg.pp_size, dp_replicate=cfg.dp_replicate_size, dp_shard=dp_shard,
            cp=cfg.cp_size, tp=cfg.tp_size,
        )  # fmt: skip

    @property
    def world_size(self) -> int:
        """Ranks in the mesh."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks, each with its own rows of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded; CP ranks join the shard axis so FSDP sums their gradients."""
        return self.dp_shard * self.cp > 1

    def check_model(self, config: PretrainedConfig) -> None:
        """Raise a ValueError naming the config key if `config`'s model cannot be split so."""
        if getattr(config, "vision_config", None) is not None:
            split = [f"{k}_size" for k, n in (("pp", self.pp), ("cp", self.cp)) if n > 1]
            if split:
                raise ValueError(
                    f"{KEY}.{', '.join(split)} > 1: a vision-language model ({config.model_type}) "
                    "is split data-parallel (FSDP2 shards its vision blocks and decoder layers "
                    "alike) and tensor-parallel (tp_size: its language model) only so far"
                )
            config = config.get_text_config()
        if self.tp > 1:
            if config.model_type not in TP_PLANS:
                raise ValueError(
                    f"{KEY}.tp_size > 1 has no plan for model_type {config.model_type!r}; "
                    f"supported: {sorted(TP_PLANS)}"
                )
            for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
                value = getattr(config, name)
                if value % self.tp:
                    raise ValueError(f"{KEY}.tp_size ({self.tp}) must divide {name} ({value})")
            if config.vocab_size % self.tp:
                raise ValueError(
                    f"{KEY}.tp_size ({self.tp}) must divide vocab_size ({config.vocab_size})"
                )
        if self.pp > config.num_hidden_layers:
            raise ValueError(
                f"{KEY}.pp_size ({self.pp}) must not exceed num_hidden_layers "
                f"({config.num_hidden_layers}): every stage needs a decoder layer"
            )
        if self.cp > 1 and self.pp > 1:
            raise ValueError(f"{KEY}: cp_size > 1 together with pp_size > 1 is not supported")
        if self.cp > 1 and config._attn_implementation != "sdpa":
            raise ValueError(
                f"{KEY}.cp_size > 1 needs SDPA attention (context parallelism replaces its "
                f"calls); the model uses {config._attn_implementation!r}"
            )
        if self.cp > 1 and _windowed_attention(config):
            raise ValueError(
                f"{KEY}.cp_size > 1 splits sequences under a plain causal mask; this model's "
                "sliding-window attention layers are not supported with it"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh over all ranks of the default process group, plus flattened axes
        "dp" (data loading), "dp_shard_cp" (FSDP sharding) and "dp_cp" (loss sums)."""
        assert dist.get_world_size() == self.world_size, (dist.get_world_size(), self)
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_AXES,
        )
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh


# ---------------------------------------------------------------------------------------------
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


TP_PLANS: dict[str, Callable[[], tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]]] = {
    "llama": _decoder_tp_plan,
    "qwen2": _decoder_tp_plan,
    "qwen3": _qwen3_tp_plan,
    "qwen2_5_vl_text": _decoder_tp_plan,  # Qwen2.5-VL's language model
    "qwen3_vl_text": _qwen3_tp_plan,  # Qwen3-VL's
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
    deepstack = len(getattr(_config(model).vision_config, "deepstack_visual_indexes", None) or [])
    layers = len(_layers(model))
    return root, [through_layer if i < deepstack else into_layer for i in range(layers)]


def _decoder(model: nn.Module) -> Any:
    """The decoder stack (`model.model`) of an HF causal LM or of a pipeline stage; of a
    vision-language model, its language model's (`model.model.language_model`)."""
    decoder = getattr(model, "model", None)
    if decoder is not None and hasattr(decoder, "language_model"):
        decoder = decoder.language_model
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError(
            f"{type(model).__name__} has no `model.layers`; nebula-rl parallelises Hugging Face "
            "decoder-only causal LMs"
        )
    return decoder


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(_decoder(model).layers.children())


def _vision_blocks(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision tower blocks (`model.model.visual.blocks`); none for a
    language model."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    blocks = getattr(visual, "blocks", None)
    return list(blocks.children()) if blocks is not None else []


def _visual(model: nn.Module) -> nn.Module:
    """A vision-language model's vision tower (`model.model.visual`)."""
    return model.get_submodule("model.visual")


def _config(model: nn.Module) -> Any:
    return model.config


def _tied(model: nn.Module) -> bool:
    return bool(_config(model).tie_word_embeddings)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard `model` (an HF causal LM or a pipeline stage of one, or a vision-language model's
    language model) over `tp_mesh`, in place."""
    root, layer_plan = TP_PLANS[_config(model).get_text_config().model_type]()
    decoder = _decoder(model)
    layers = list(decoder.layers.children())
    own: list[ParallelStyle | None] = [None] * len(layers)  # a layer's own inputs and outputs
    if _vision_blocks(model):
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
    if _tied(model) and _has(model, "lm_head") and getattr(decoder, "embed_tokens", None):
        head: Any = model.lm_head
        head.weight = decoder.embed_tokens.weight


def _has(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


# ---------------------------------------------------------------------------------------------
# Pipeline parallel


class _DecoderPart(nn.Module):
    """Some decoder layers of an HF decoder (one pipeline stage of several on a rank), with its
    embedding, final norm and rotary embedding where the stage needs them; the attribute names
    are the decoder's, so the parameters keep their names in the full model."""

    def __init__(self, decoder: Any, layer_ids: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): decoder.layers[str(i)] for i in layer_ids})
        self.norm = decoder.norm if last else None
        self.rotary_emb = decoder.rotary_emb


class _PipelineStageModule(nn.Module):
    """Decoder layers of an HF causal LM (`decoder.layers`, keyed by their index), plus the
    embedding where they include the first layer and the final norm and head (`lm_head`) where
    they include the last. Parameter names are those of the full model.

    `split_pipeline` makes one per rank holding all of the rank's layers
    (`ParallelModel.module`); with several stages per rank (Interleaved1F1B), each stage is
    another one sharing that module's layers."""

    def __init__(
        self, config: Any, decoder: Any, lm_head: Any, *, tp_mesh: DeviceMesh | None
    ) -> None:
        super().__init__()
        self.config, self.tp_mesh = config, tp_mesh
        self.compute_dtype: torch.dtype | None = None
        """Autocast dtype of the forward (mixed precision without FSDP); set by ParallelModel."""
        self.model: Any = decoder
        self.lm_head: Any = lm_head

    def forward(self, h: Tensor) -> Tensor:
        """Token ids [b, l] (first stage) or hidden states [b, l, H] -> hidden states, or logits
        [b, l, V] on the last stage."""
        autocast = (
            torch.autocast(h.device.type, dtype=self.compute_dtype)
            if self.compute_dtype is not None
            else nullcontext()
        )
        with autocast:
            return self._forward(h)

    def _forward(self, h: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        decoder = self.model
        if decoder.embed_tokens is not None:
            h = decoder.embed_tokens(h)
        elif self.tp_mesh is not None:
            # Stages exchange plain tensors; under TP they are this rank's sequence shard.
            h = DTensor.from_local(h, self.tp_mesh, [Shard(1)], run_check=False)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask_kwargs: dict[str, Any] = dict(
            config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
            position_ids=position_ids,
        )  # fmt: skip
        layer_types = getattr(self.config, "layer_types", None) or []
        masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if "sliding_attention" in layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        position_embeddings = decoder.rotary_emb(h, position_ids)
        for index, layer in decoder.layers.items():
            kind = layer_types[int(index)] if layer_types else "full_attention"
            h = layer(
                h,
                attention_mask=masks[kind],
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
        if self.lm_head is None:
            return h.to_local() if isinstance(h, DTensor) else h
        return self.lm_head(decoder.norm(h))


PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
"""`policy.parallelism.pp_schedule` values: one stage per rank (1F1B, GPipe) or several
(Interleaved1F1B)."""


def pipeline_stage_layers(
    num_layers: int, *, pp: int, schedule: str, layers_per_stage: int | None = None
) -> list[range]:
    """The decoder layers of every pipeline stage, in order; stage s runs on pp rank s % pp.

    1F1B and GPipe: one stage per rank, the layers shared as evenly as they divide.
    Interleaved1F1B: stages of `layers_per_stage` layers (`pp_layers_per_stage`), which must
    divide the layers into a multiple of `pp` stages, at least two per rank (with one, use
    1F1B); other layer counts are refused, naming the keys.
    """
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"{KEY}.pp_schedule must be one of {PP_SCHEDULES}, got {schedule!r}")
    if pp > num_layers:
        raise ValueError(
            f"{KEY}.pp_size ({pp}) must not exceed num_hidden_layers ({num_layers}): every "
            "stage needs a decoder layer"
        )
    if schedule != "Interleaved1F1B":
        return [range(s * num_layers // pp, (s + 1) * num_layers // pp) for s in range(pp)]
    k = layers_per_stage
    if k is None or num_layers % k:
        raise ValueError(
            f"{KEY}.pp_layers_per_stage ({k}) must divide num_hidden_layers ({num_layers}) "
            "with pp_schedule = 'Interleaved1F1B'"
        )
    num_stages = num_layers // k
    if num_stages % pp or num_stages < 2 * pp:
        raise ValueError(
            f"{KEY}: pp_schedule = 'Interleaved1F1B' needs a multiple of pp_size ({pp}) stages, "
            f"at least 2 per rank; num_hidden_layers ({num_layers}) / pp_layers_per_stage ({k}) "
            f"gives {num_stages}. Choose another pp_layers_per_stage, or pp_schedule = '1F1B'"
        )
    return [range(s * k, (s + 1) * k) for s in range(num_stages)]


def split_pipeline(
    model: nn.Module,
    stage_layers: Sequence[range],
    *,
    pp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None = None,
) -> tuple[_PipelineStageModule, list[tuple[int, nn.Module]]]:
    """This rank's part of `model` and its pipeline stages: (the module of all its layers,
    [(stage index, stage module)]). Stage s of `stage_layers` runs on pp rank s % pp; with one
    stage per rank the stage module is the rank's module.

    `model` is consumed: the rank's module takes its modules and the rest is dropped.
    """
    rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    config = _config(model)
    last = config.num_hidden_layers - 1
    mine = [(s, layers) for s, layers in enumerate(stage_layers) if s % pp == rank]
    layer_ids = [i for _, layers in mine for i in layers]
    decoder = _decoder(model)
    # The HF decoder keeps only this rank's modules from here on; a ModuleDict keyed by the
    # layer's index keeps the names "model.layers.<i>.*".
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layer_ids})
    if 0 not in layer_ids:
        decoder.embed_tokens = None
    if last not in layer_ids:
        decoder.norm = None
    head = model.lm_head if last in layer_ids else None
    whole = _PipelineStageModule(config, decoder, head, tp_mesh=tp_mesh)
    if len(mine) == 1:
        return whole, [(mine[0][0], whole)]
    stages: list[tuple[int, nn.Module]] = []
    for s, layers in mine:
        first, final = layers.start == 0, layers.stop == last + 1
        part = _DecoderPart(decoder, layers, first=first, last=final)
        stages.append(
            (s, _PipelineStageModule(config, part, head if final else None, tp_mesh=tp_mesh))
        )
    return whole, stages


def split_pipeline_stage(
    model: nn.Module, *, pp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None
) -> nn.Module:
    """This rank's pipeline stage of `model` with one stage per rank (an equal share of the
    decoder layers, in order). `model` is consumed."""
    layers = pipeline_stage_layers(
        _config(model).num_hidden_layers, pp=pp_mesh.size(), schedule="1F1B"
    )
    whole, _ = split_pipeline(model, layers, pp_mesh=pp_mesh, tp_mesh=tp_mesh)
    return whole


def _tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of this rank and its peer holding the other side of a tied embedding (first and
    last pipeline stage, same coordinates on the other axes); None on middle stages."""
    grid = mesh.mesh
    mine = None
    # Every rank creates every pair, in the same order, as new_group requires.
    for first, last in zip(grid[0].flatten().tolist(), grid[-1].flatten().tolist(), strict=True):
        group = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            mine = group
    return mine


# ---------------------------------------------------------------------------------------------
# Activation checkpointing, compile, data parallel


def apply_ac(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (composable, names unchanged)."""
    from torch.distributed._composable import checkpoint

    for layer in _layers(model):
        checkpoint(layer)


def apply_compile(model: nn.Module) -> None:
    """`torch.compile` each decoder layer in place (the layers are alike, so compiled once)."""
    for layer in _layers(model):
        layer.compile()


def _sum_gradients(model: nn.Module, divide: float = 1.0) -> None:
    """Make every FSDP/replicate group sum gradients over its data axes instead of averaging:
    each rank's loss is already its share of the global loss (module docstring). With
    `divide`, the sums are divided by it."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(divide)
            # A plain SUM: gloo has no AVG/PREMUL_SUM, and a factor of 1 needs no scaling.
            module.set_force_sum_reduction_for_comms(True)


def _fsdp_precision(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> Any:
    """FSDP2's mixed precision: gather parameters in `param_dtype` for forward and backward
    (None: their own dtype, the master copy's), reduce gradients in `reduce_dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: Literal["always", "never", "default"] = "default",
    pipelined: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    offload: bool = False,
) -> None:
    """FSDP2 over `dp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP): one group per decoder
    layer, then the root, which holds the embedding, final norm and (tied) head together.

    `reshard_after_forward` (`train.fsdp_reshard_after_forward`): whether a group frees its
    gathered parameters after forward, "always" or "never" for every group; "default" is
    torch's default (the layers do, the root does not: its parameters are needed again as soon
    as backward starts), except for a `pipelined` stage, whose layers do not either (it runs
    several micro-batches: resharding would re-gather them for each). `param_dtype` /
    `reduce_dtype` are the mixed precision (`train.param_dtype`, `train.fsdp_reduce_dtype`);
    `offload` keeps the shards and optimiser state in host memory (`train.fsdp_offload`, CUDA
    only).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if offload and dp_mesh.device_type != "cuda":
        raise ValueError(
            "train.fsdp_offload moves the sharded parameters from GPU to host memory; this "
            f"replica's devices are {dp_mesh.device_type!r}, so there is nothing to offload"
        )
    reshard = {"always": True, "never": False, "default": False if pipelined else None}
    kwargs: dict[str, Any] = dict(
        mesh=dp_mesh,
        reshard_after_forward=reshard[reshard_after_forward],
        mp_policy=_fsdp_precision(param_dtype, reduce_dtype),
        offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
    )
    from torch.distributed.fsdp import FSDPModule

    for layer in [*_vision_blocks(model), *_layers(model)]:
        if not isinstance(layer, FSDPModule):  # (a vision block `shard_vision_over_tp` took)
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    _sum_gradients(model)


def shard_vision_over_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """FSDP2 of a vision-language model's vision tower over the data and TP ranks together
    (`tp_size > 1`; the language model is TP-split): the tower is never TP-split, and with its
    parameters sharded like the language model's DTensors every parameter of the model is one.
    Each block is a group, then the tower's root (patch and position embeddings, mergers).

    TP ranks run the same rows, so their tower gradients are equal: summed over the TP ranks
    they are divided by `tp_size` again, and data ranks' are summed as everywhere (set after
    the data-parallel step, whose own setting covers every FSDP group)."""
    from torch.distributed.fsdp import fully_shard

    axes = ("dp_shard", "cp", "tp")
    if "dp_shard_cp_tp" not in (mesh.mesh_dim_names or ()):
        mesh[axes]._flatten("dp_shard_cp_tp")
    over = (
        mesh["dp_replicate", "dp_shard_cp_tp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp_tp"]
    )
    visual = _visual(model)
    kwargs: dict[str, Any] = dict(mesh=over, mp_policy=_fsdp_precision(param_dtype, reduce_dtype))
    for block in _vision_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(visual, **kwargs)


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """Replicated data parallel over `dp_mesh` (FSDP2's replicate: one all-reduce per layer),
    with the mixed precision of `apply_fsdp`."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    precision = _fsdp_precision(param_dtype, reduce_dtype)
    for layer in _layers(model):
        replicate(layer, mesh=dp_mesh, mp_policy=precision)
    replicate(model, mesh=dp_mesh, mp_policy=precision)
    _sum_gradients(model)


# ---------------------------------------------------------------------------------------------
# Composition

SCHEDULE_CACHE_SIZE = 8
"""Pipeline schedules kept per ParallelModel, one per batch shape (see `_pipeline_run`)."""


def total_grad_norm(grads: Sequence[Tensor]) -> Tensor:
    """The 2-norm of `grads` together (over all shards of DTensors: a collective), accumulated
    in float64: float32 norms of tensors of 1e5 elements are off by ~1e-5 on CPU."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    totals = []
    for group in _by_mesh(grads):
        norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in group]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        totals.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(totals))


def _by_mesh(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """`tensors` grouped by device mesh (plain tensors together), in first-seen order: DTensor
    ops take one mesh at a time (a vision tower sharded over more ranks than the language
    model's parameters is on another mesh)."""
    groups: dict[Any, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def _full(param: Tensor) -> Tensor:
    """`param` whole and detached (gathered if it is a sharded DTensor: a collective)."""
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach()


def whole_model_loss(
    module: nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    loss_fn: LossFn,
    *,
    backward: bool,
    compute_dtype: torch.dtype | None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    inputs: Mapping[str, Tensor] | None = None,
    touch_vision: bool = False,
) -> Tensor:
    """`loss_fn(logits, labels)` of `module` (an HF causal LM) run on this rank's whole rows,
    forward autocast to `compute_dtype` (None: the parameters' own), backpropagated with
    `backward`; the caller sets grad mode. `inputs` are more keyword arguments of the forward
    (a vision-language model's pixels). `touch_vision`: a vision-language model runs its
    vision tower on images and on videos in every pass, those its rows lack being blank ones on
    one more row, whose output counts zero (see `_with_blank_media`)."""
    blank = touch_vision and not all(k in (inputs or {}) for k in _PIXEL_KEYS)
    length = input_ids.shape[1]
    if blank:
        if attention_mask is not None or position_ids is not None:
            raise ValueError(
                "train.sequence_packing: packed rows cannot be trained data-parallel with a "
                "vision-language model; turn packing off"
            )
        input_ids, inputs = _with_blank_media(module, input_ids, inputs)
    autocast = (
        nullcontext()
        if compute_dtype is None
        else torch.autocast(input_ids.device.type, dtype=compute_dtype)
    )
    with autocast:
        logits = module(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **(inputs or {}),
        ).logits
        if blank:  # the blank row's logits count zero, but do reach the vision tower
            logits = logits[:-1, :length] + 0.0 * logits[-1].sum()
        if never := media_token_ids(_config(module)):  # (as the rollout engine samples)
            logits = logits.index_fill(-1, torch.tensor(never, device=logits.device), -1e9)
    loss = loss_fn(logits, labels)
    if backward:
        loss.backward()
    return loss


_PIXEL_KEYS = ("pixel_values", "pixel_values_videos")


def _with_blank_media(
    module: nn.Module, input_ids: Tensor, inputs: Mapping[str, Tensor] | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """`input_ids` with one more row holding a blank image (`<|vision_start|><|image_pad|>
    <|vision_end|>`) if the pass has no image, and a blank video likewise if it has no video,
    each one language token, with their pixels appended to the pass's.

    Data-parallel ranks run the same collectives per forward and backward: FSDP all-gathers
    each vision block before the model uses it and reduce-scatters its gradients after, DDP
    all-reduces them. Qwen-VL forwards run the vision tower once for the images, then once for
    the videos; a rank whose rows hold no image (or no video) would skip a run another rank
    makes, and their collectives would no longer pair up. With both kinds always present, every
    rank runs the tower twice, at the same points of the forward."""
    model_config: Any = _config(module)
    config = model_config.vision_config
    merge = int(config.spatial_merge_size)
    width = int(config.in_channels * config.temporal_patch_size * config.patch_size**2)
    given = dict(inputs or {})
    missing = [
        (kind, token, pixels, grid)
        for kind, token, pixels, grid in (
            (1, model_config.image_token_id, "pixel_values", "image_grid_thw"),
            (2, model_config.video_token_id, "pixel_values_videos", "video_grid_thw"),
        )
        if pixels not in given
    ]
    rows, length = input_ids.shape
    ids = input_ids.new_zeros((rows + 1, max(length, 3 * len(missing))))
    ids[:rows, :length] = input_ids
    types = ids.new_zeros(ids.shape)
    if "mm_token_type_ids" in given:
        types[:rows, :length] = given["mm_token_type_ids"]
    device = input_ids.device
    for i, (kind, token, pixels, grid) in enumerate(missing):
        start, end = model_config.vision_start_token_id, model_config.vision_end_token_id
        ids[rows, 3 * i : 3 * i + 3] = torch.tensor([start, token, end])
        types[rows, 3 * i + 1] = kind
        given[pixels] = torch.zeros(merge * merge, width, device=device)
        given[grid] = torch.tensor([[1, merge, merge]], device=device)
    return ids, {**given, "mm_token_type_ids": types}


def _windowed_attention(config: PretrainedConfig) -> bool:
    """Whether some attention layer of `config`'s model attends over a sliding window."""
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return any(kind != "full_attention" for kind in layer_types)
    if hasattr(text, "use_sliding_window"):
        return bool(text.use_sliding_window)
    return getattr(text, "sliding_window", None) is not None


def shard_logits(module: nn.Module, input_ids: Tensor, position_ids: Tensor) -> Tensor:
    """The logits of a CP rank's share of each sequence, under the causal mask of the tokens'
    positions. A share's positions jump (its head chunk, then its tail chunk), which
    transformers reads as packed sequences, masking each chunk on its own (and, on CUDA,
    handing torch's ring attention a mask it refuses). An explicit all-ones padding mask turns
    that detection off: attention then runs as SDPA's `is_causal` without a mask, the form the
    ring attention shards and `sequence_split.GatheredAttention` re-masks by position."""
    padding = torch.ones_like(input_ids)
    out = module(
        input_ids=input_ids, position_ids=position_ids, attention_mask=padding, use_cache=False
    )
    return out.logits


def _pad_rows_columns(tensor: Tensor, rows: int, columns: int) -> Tensor:
    """`tensor` [b, l, ...] right-padded with zeros to [rows, columns, ...]."""
    if tensor.shape[0] == rows and tensor.shape[1] == columns:
        return tensor
    out = tensor.new_zeros((rows, columns, *tensor.shape[2:]))
    out[: tensor.shape[0], : tensor.shape[1]] = tensor
    return out


class ParallelModel:
    """One rank's part of a parallelised model, and how a training step runs on it.

    A step is `forward_backward` (or `run`; once per batch, or several times to accumulate),
    then `reduce_tied_grads`, `clip_grad_norm_` and the optimiser over `parameters()`.

    Pipeline batches: every call is cut into micro-batches of `pp_micro_batch_size` rows, and
    all data-parallel ranks run the same number of them on the same shape (FSDP's collectives
    pair up across them): a call's rows and columns are padded with zeros to the largest over
    the data-parallel ranks, and its micro-batches to a count the schedule can run (1F1B: at
    least pp_size; Interleaved1F1B: a multiple of its rounds, max(1, n // pp_size)). A padded
    row has labels of zero, so `loss_fn` must give it no loss (the trainer's losses weigh
    tokens by a mask carried in the labels).
    """

    def __init__(
        self,
        module: nn.Module,
        dims: ParallelDims,
        mesh: DeviceMesh,
        *,
        stages: Sequence[tuple[int, nn.Module]] = (),
        num_stages: int = 1,
        pp_schedule: str = "1F1B",
        pp_micro_batch_size: int = 1,
        tied_group: dist.ProcessGroup | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.module, self.dims, self.mesh = module, dims, mesh
        self.stages = list(stages)
        """(stage index, stage module) of this rank under PP."""
        self.num_stages, self.pp_schedule = num_stages, pp_schedule
        self.pp_micro_batch_size = pp_micro_batch_size
        self.compute_dtype = compute_dtype
        """Autocast dtype of forward passes (`train.param_dtype` where no FSDP casts the
        parameters); None: the parameters' own."""
        self._tied_group = tied_group
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        self._loss_fn: LossFn | None = None
        # (see `_vision_zero`)
        self._touch_vision = dims.dp > 1 and _vision_blocks(module) != []
        for _, stage in self.stages:
            stage.compute_dtype = compute_dtype  # type: ignore[assignment]

    @property
    def dp_rank(self) -> int:
        """Which of the `dims.dp` shares of the batch's rows this rank takes."""
        return self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (shares of the batch's rows)."""
        return self.dims.dp

    @property
    def computes_loss(self) -> bool:
        """Whether `loss_fn` runs on this rank: every rank without PP, the last stage's with."""
        return self.dims.pp == 1 or any(i == self.num_stages - 1 for i, _ in self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (DTensors where sharded), for the optimiser."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the full model."""
        return self.module.named_parameters()

    def _autocast(self, device_type: str) -> Any:
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def run(
        self,
        input_ids: Tensor,
        labels: Tensor,
        loss_fn: LossFn,
        *,
        backward: bool,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs: Mapping[str, Tensor] | None = None,
    ) -> list[Tensor]:
        """Forward (and with `backward`, backward) of this rank's rows; the losses `loss_fn`
        returned on this rank (one per pipeline micro-batch on the last stage, none on the
        other stages; one otherwise), unreduced and as returned.

        `input_ids` [b, l] are this rank's rows (`dp_rank`), all of their columns; `labels`
        [b, l, ...] is any per-token tensor aligned with them (e.g. the next token ids), cut the
        same way as the inputs (micro-batches under PP, sequence shards under CP) before
        `loss_fn(logits, labels)` sees it. Without `backward` it runs under no_grad. A prepared
        `attention_mask` (packed rows, with their `position_ids`) only goes to an unsplit
        forward: PP and CP take right-padded rows, for which the causal mask is exact. `inputs`
        (a vision-language model's pixels) also go to an unsplit forward only.
        """
        if inputs and (self.dims.pp > 1 or self.dims.cp > 1):
            raise ValueError(
                "vision-language inputs (images, videos) are not supported with "
                "policy.parallelism.pp_size > 1 or cp_size > 1 yet"
            )
        if attention_mask is not None and (self.dims.pp > 1 or self.dims.cp > 1):
            raise ValueError(
                "train.sequence_packing (packed rows with a block-diagonal attention mask) is "
                "not supported with policy.parallelism.pp_size > 1 or cp_size > 1: pipeline "
                "and context parallel take right-padded rows"
            )
        with torch.enable_grad() if backward else torch.no_grad():
            if self.dims.pp > 1:
                return self._pipeline_run(input_ids, labels, loss_fn, backward=backward)
            if self.dims.cp > 1:
                return [self._context_parallel_run(input_ids, labels, loss_fn, backward=backward)]
            return [
                whole_model_loss(
                    self.module,
                    input_ids,
                    labels,
                    loss_fn,
                    backward=backward,
                    compute_dtype=self.compute_dtype,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    inputs=inputs,
                    touch_vision=self._touch_vision,
                )
            ]

    def forward_backward(self, input_ids: Tensor, labels: Tensor, loss_fn: LossFn) -> Tensor:
        """`run` with backward; returns the global batch's loss: summed over micro-batches,
        sequence shards and data-parallel ranks, the same on every rank."""
        pieces = self.run(input_ids, labels, loss_fn, backward=True)
        loss = torch.zeros((), device=input_ids.device)
        if pieces:
            loss = torch.stack([p.detach().float() for p in pieces]).sum()
        if self.dims.pp > 1:  # only the last stage has it; the others hold 0
            dist.all_reduce(loss, group=self.mesh["pp"].get_group())
        dist.all_reduce(loss, group=self.mesh["dp_cp"].get_group())
        return loss

    def _usable_micro_batches(self, n: int) -> int:
        """The smallest count >= n that the schedule runs (see the class docstring)."""
        pp = self.dims.pp
        if self.pp_schedule == "1F1B":
            return max(n, pp)
        if self.pp_schedule == "Interleaved1F1B":
            while n % max(1, n // pp):
                n += 1
        return n

    def _pipeline_run(
        self, input_ids: Tensor, labels: Tensor, loss_fn: LossFn, *, backward: bool
    ) -> list[Tensor]:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        size = self.pp_micro_batch_size
        # Every data-parallel rank runs the same micro-batches on the same shape: FSDP gathers
        # and reduces per micro-batch, and a new shape builds a new schedule, whose metadata
        # inference runs a forward of its own.
        wanted = torch.tensor([-(-input_ids.shape[0] // size), input_ids.shape[1]])
        if self.dims.dp > 1:
            staged = wanted.to(input_ids.device)
            dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=self.mesh["dp"].get_group())
            wanted = staged.cpu()
        n = self._usable_micro_batches(max(int(wanted[0]), 1))
        rows, columns = n * size, max(int(wanted[1]), 1)
        input_ids = _pad_rows_columns(input_ids, rows, columns)
        labels = _pad_rows_columns(labels, rows, columns)
        key = (rows, columns, tuple(labels.shape[2:]), labels.dtype, backward)
        schedule = self._schedules.get(key)
        fresh = schedule is None
        if schedule is None:
            # Stages are built per shape: torch's PipelineStage infers its send/receive buffers
            # from the first batch it sees.
            device = input_ids.device
            group = self.mesh["pp"].get_group()
            stages = [
                PipelineStage(module, index, self.num_stages, device, group=group)
                for index, module in self.stages
            ]
            kind: Any = {
                "GPipe": ScheduleGPipe,
                "1F1B": Schedule1F1B,
                "Interleaved1F1B": ScheduleInterleaved1F1B,
            }[self.pp_schedule]
            schedule = kind(
                stages if self.pp_schedule == "Interleaved1F1B" else stages[0],
                n,
                loss_fn=lambda logits, target: self._loss_fn(logits, target),  # type: ignore[misc]
                scale_grads=False,  # the shares of the global loss already add up
            )
            self._schedules[key] = schedule
            if len(self._schedules) > SCHEDULE_CACHE_SIZE:
                self._schedules.popitem(last=False)
        self._schedules.move_to_end(key)
        self._loss_fn = loss_fn
        first = any(index == 0 for index, _ in self.stages)
        losses: list[Tensor] = []
        args = (input_ids,) if first else ()
        target = labels if self.computes_loss else None
        # A new schedule's metadata inference runs a forward and backward of its own and then
        # clears the gradients of FSDP's parameters: keep those of earlier calls aside.
        saved = [(p, p.grad) for p in self.module.parameters()] if fresh else []
        for p, _ in saved:
            p.grad = None
        if backward:
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        for p, grad in saved:
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad
        return losses

    def _context_parallel_run(
        self, input_ids: Tensor, labels: Tensor, loss_fn: LossFn, *, backward: bool
    ) -> Tensor:
        # Each rank takes one chunk of the sequence from each end (for balance): pad the
        # columns (right padding is exact under the causal mask) to a multiple of 2 * cp_size.
        multiple = 2 * self.dims.cp
        length = -(-input_ids.shape[1] // multiple) * multiple
        # context_parallel shards its buffers in place: work on (padded) copies.
        input_ids = _pad_rows_columns(input_ids, input_ids.shape[0], length).clone()
        labels = _pad_rows_columns(labels, labels.shape[0], length).clone()
        position_ids = torch.arange(length, device=input_ids.device).repeat(input_ids.shape[0], 1)
        if self.mesh.device_type != "cuda":
            return self._gathered_context_parallel_run(
                input_ids, labels, position_ids, loss_fn, backward=backward
            )
        from torch.distributed.tensor.experimental import context_parallel

        buffers = [input_ids, labels, position_ids]
        with context_parallel(
            self.mesh["cp"],
            buffers=buffers,
            buffer_seq_dims=[1, 1, 1],
            no_restore_buffers=set(buffers),
        ):
            with self._autocast(input_ids.device.type):
                logits = shard_logits(self.module, input_ids, position_ids)
            loss = loss_fn(logits, labels)
            if backward:
                loss.backward()
        return loss

    def _gathered_context_parallel_run(
        self,
        input_ids: Tensor,
        labels: Tensor,
        position_ids: Tensor,
        loss_fn: LossFn,
        *,
        backward: bool,
    ) -> Tensor:
        """CP without CUDA's ring attention (torch's CPU SDPA kernel has no sharding rule): this
        rank takes the same columns torch's load balancer gives it (chunk r and chunk
        2 cp - 1 - r of 2 cp), and every attention call all-gathers the keys and values of the
        group's ranks and masks them by the tokens' positions (`sequence_split`)."""
        cp_mesh = self.mesh["cp"]
        cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        chunk = input_ids.shape[1] // (2 * cp)
        device = input_ids.device

        def columns(r: int) -> Tensor:
            head = torch.arange(r * chunk, (r + 1) * chunk, device=device)
            return torch.cat([head, head + (2 * cp - 1 - 2 * r) * chunk])

        mine = columns(rank)
        gathered = torch.cat([columns(r) for r in range(cp)])  # (the keys' order)
        mask = gathered[None, :] <= mine[:, None]
        with GatheredAttention(cp_mesh.get_group(), mask), self._autocast(device.type):
            logits = shard_logits(self.module, input_ids[:, mine], position_ids[:, mine])
        loss = loss_fn(logits, labels[:, mine])
        if backward:
            loss.backward()
        return loss

    def gather_loss_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """Metrics of the losses this rank computed (`run`), made its data-parallel rank's:
        summed over the sequence shards (CP), and under PP the last stage's, on every stage.
        CP ranks must pass the same keys."""
        if self.dims.cp > 1 and values:
            keys = sorted(values)
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            totals = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
            dist.all_reduce(totals, group=self.mesh["cp"].get_group())
            values = dict(zip(keys, totals.tolist(), strict=True))
        if self.dims.pp > 1:
            box: list[dict[str, float]] = [values if self.computes_loss else {}]
            dist.broadcast_object_list(
                box, group=self.mesh["pp"].get_group(), group_src=self.dims.pp - 1
            )
            values = box[0]
        return values

    def full_named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter of the whole model under its name, gathered whole, on every rank: a
        collective over the process group, which every rank must run to the end. Under PP the
        stages take turns (pp rank 0's parameters first), each tensor broadcast over the pp
        group; a tied embedding then appears under both of its names."""
        mine = list(self.module.named_parameters())
        if self.dims.pp == 1:
            for name, param in mine:
                yield name, _full(param)
            return
        group = self.mesh["pp"].get_group()
        metas: list[Any] = [None] * self.dims.pp
        shapes = [(name, tuple(param.shape), param.dtype) for name, param in mine]
        dist.all_gather_object(metas, shapes, group=group)
        rank = self.mesh["pp"].get_local_rank()
        device = (
            torch.device(self.mesh.device_type, torch.cuda.current_device())
            if (self.mesh.device_type == "cuda")
            else torch.device("cpu")
        )
        for source, entries in enumerate(metas):
            for i, (name, shape, dtype) in enumerate(entries):
                if source == rank:
                    tensor = _full(mine[i][1]).to(device)
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, group=group, group_src=source)
                yield name, tensor

    def _tied_head(self) -> nn.Parameter | None:
        """The last stage's copy of a tied embedding (counted once by `clip_grad_norm_`)."""
        if self._tied_group is None or self.mesh["pp"].get_local_rank() != self.dims.pp - 1:
            return None
        return self.module.lm_head.weight  # type: ignore[union-attr, return-value]

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of a tied embedding's two copies (first and last pipeline stage).
        Call once per optimiser step, after the last backward; a no-op without PP."""
        if self._tied_group is None:
            return
        stage = self.mesh["pp"].get_local_rank()
        module: Any = self.module
        weight = module.model.embed_tokens.weight if stage == 0 else module.lm_head.weight
        if weight.grad is None:  # (frozen, or no batch reached it)
            weight.grad = torch.zeros_like(weight)
        grad = weight.grad
        if isinstance(grad, DTensor):
            # Under TP the embedding's gradient comes back replicated while the head's is
            # sharded like the weight; the copies' local pieces must match to be summed.
            if grad.placements != weight.placements:
                grad = weight.grad = grad.redistribute(grad.device_mesh, weight.placements)
            grad = grad.to_local()
        dist.all_reduce(grad, group=self._tied_group)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients down to a total 2-norm of at most `max_norm` (none: inf); the
        norm over the whole model (every shard and stage, a tied embedding once), returned."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        head = self._tied_head()
        norm = total_grad_norm([p.grad for p in params if p is not head and p.grad is not None])
        if self.dims.pp > 1:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            squared = (norm**2).to(device)
            dist.all_reduce(squared, group=self.mesh["pp"].get_group())
            norm = squared.sqrt()
        if max_norm < float("inf"):
            for group in _by_mesh(params):
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return float(norm)


def parallelize_model(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    pp_micro_batch_size: int = 1,
    pp_schedule: str = "1F1B",
    pp_layers_per_stage: int | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: Literal["always", "never", "default"] = "default",
    offload: bool = False,
) -> ParallelModel:
    """Split `model` (an HF causal LM, the same weights on every rank) over `mesh`, in place.

    The order is torchtitan's; each step needs what the previous one leaves. `pp_*` are
    `[policy.parallelism]`'s pipeline keys (`pipeline_stage_layers`). The last four arguments
    are `[train]`'s precision and FSDP2 settings: the compute dtype (None: the parameters' own;
    FSDP2 and DDP cast the parameters to it, otherwise forward passes autocast to it),
    `fsdp_reduce_dtype`, `fsdp_reshard_after_forward` and `fsdp_offload` (see `apply_fsdp`).
    """
    if offload and not dims.fsdp_enabled:
        raise ValueError(
            "train.fsdp_offload needs sharded parameters (policy.parallelism.dp_shard_size > 1)"
        )
    dims.check_model(_config(model))
    config = _config(model).get_text_config()  # (a vision-language model's language model)
    tied = _tied(model)
    tp_mesh = mesh["tp"] if dims.tp > 1 else None
    stage_layers = [range(config.num_hidden_layers)]
    stages: list[tuple[int, nn.Module]] = []
    # 1. PP first: every later step applies to this rank's stages only.
    if dims.pp > 1:
        stage_layers = pipeline_stage_layers(
            config.num_hidden_layers,
            pp=dims.pp,
            schedule=pp_schedule,
            layers_per_stage=pp_layers_per_stage,
        )
        model, stages = split_pipeline(model, stage_layers, pp_mesh=mesh["pp"], tp_mesh=tp_mesh)
    # 2. TP(+SP) on the plain modules: the plan names HF modules, and FSDP below must see the
    #    TP-sharded DTensor parameters to shard them further (2-D parameters).
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    # 3. Activation checkpointing per decoder layer, inside FSDP's per-layer groups, so that
    #    recomputation happens while the layer's parameters are gathered anyway.
    if activation_checkpointing:
        apply_ac(model)
    # 4. torch.compile per layer, after AC so that the recomputed region is the compiled one.
    if compile:
        apply_compile(model)
    # 5. Data parallel last: it wraps whatever the layers have become, one root per pipeline
    #    stage. CP ranks are FSDP ranks (dp_shard_cp): they hold different tokens, so their
    #    gradients are summed like DP's.
    roots = [stage for _, stage in stages] or [model]
    if tp_mesh is not None and _vision_blocks(model):
        shard_vision_over_tp(model, mesh, dims, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if dims.fsdp_enabled:
        axes = ("dp_replicate", "dp_shard_cp") if dims.dp_replicate > 1 else ("dp_shard_cp",)
        for root in roots:
            apply_fsdp(
                root,
                mesh[axes],
                reshard_after_forward=reshard_after_forward,
                pipelined=dims.pp > 1,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                offload=offload,
            )
    elif dims.dp_replicate > 1:
        for root in roots:
            apply_ddp(
                root, mesh["dp_replicate"], param_dtype=param_dtype, reduce_dtype=reduce_dtype
            )
    if tp_mesh is not None and _vision_blocks(model):
        _sum_gradients(_visual(model), divide=float(dims.tp))
    data_parallel = dims.fsdp_enabled or dims.dp_replicate > 1
    # A tied embedding's copies live on the first and last stage; their gradients are summed
    # by ParallelModel.reduce_tied_grads.
    tied_group = _tied_embedding_group(mesh) if tied and dims.pp > 1 else None
    return ParallelModel(
        model,
        dims,
        mesh,
        stages=stages,
        num_stages=len(stage_layers),
        pp_schedule=pp_schedule,
        pp_micro_batch_size=pp_micro_batch_size,
        tied_group=tied_group,
        compute_dtype=None if data_parallel else param_dtype,
    )
