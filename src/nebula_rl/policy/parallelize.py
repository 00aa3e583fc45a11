"""Policy parallelism: how one policy replica's model is split over its devices.

`ParallelDims` turns `[policy.parallelism]` and the world size into mesh sizes, checks them against
the model and is the one place that builds the DeviceMesh, with axes
("pp", "dp_replicate", "dp_shard", "cp", "tp"). `parallelize_model` applies one `apply_*` per
parallelism in torchtitan's order (see its comments) and returns a :class:`ParallelModel`, whose
`forward_backward` runs one batch the way the parallelism needs: a plain forward and backward, a
pipeline schedule (PP), or inside `context_parallel` (CP).

Loss convention (STYLE rule 3): `loss_fn` returns its tokens' *share of the global loss*: a sum
over the tokens it sees divided by a global count that the caller passes in. Shares then add up
exactly, so gradients are summed, never averaged, over the data axes (dp_replicate, dp_shard, cp)
and over pipeline micro-batches, and the result does not depend on how the batch was split.

Simplifications: one pipeline stage per rank (GPipe or 1F1B, no interleaving); batches are
unpadded or right-padded (the causal mask alone is exact there, so no attention mask is taken);
CP needs SDPA attention and cannot be combined with PP; the TP plan covers the Llama, Qwen2 and
Qwen3 families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import PretrainedConfig

from nebula_rl.config import ParallelismConfig

__all__ = [
    "MESH_AXES",
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
    "split_pipeline_stage",
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
                f"{KEY}.cp_size > 1 needs SDPA attention (ring attention replaces it); "
                f"the model uses {config._attn_implementation!r}"
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
}
"""HF `model_type` -> its TP plan (module names as in Hugging Face's implementation)."""


def _decoder(model: nn.Module) -> Any:
    """The decoder stack (`model.model`) of an HF causal LM or of a pipeline stage."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError(
            f"{type(model).__name__} has no `model.layers`; nebula-rl parallelises Hugging Face "
            "decoder-only causal LMs"
        )
    return decoder


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(_decoder(model).layers.children())


def _config(model: nn.Module) -> Any:
    return model.config


def _tied(model: nn.Module) -> bool:
    return bool(_config(model).tie_word_embeddings)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard `model` (an HF causal LM or a pipeline stage of one) over `tp_mesh`, in place."""
    root, layer_plan = TP_PLANS[_config(model).model_type]()
    decoder = _decoder(model)
    # A pipeline stage lacks the embedding or the head; plan only what it holds.
    present = {name: style for name, style in root.items() if _has(model, name)}
    parallelize_module(model, tp_mesh, present)
    for layer in decoder.layers.children():
        parallelize_module(layer, tp_mesh, layer_plan)
    # Both sides of a tied embedding are sharded on the vocabulary (Shard(0) of [V, H]), so one
    # DTensor serves both; parallelize_module made two, re-tie them.
    if _tied(model) and _has(model, "lm_head") and _has(model, "model.embed_tokens"):
        head: Any = model.lm_head
        head.weight = decoder.embed_tokens.weight


def _has(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


# ---------------------------------------------------------------------------------------------
# Pipeline parallel


class _PipelineStageModule(nn.Module):
    """Decoder layers [start, stop) of an HF causal LM, plus the embedding on the first stage and
    the final norm and head on the last. Parameter names are those of the full model."""

    def __init__(self, model: nn.Module, layer_ids: range, *, tp_mesh: DeviceMesh | None) -> None:
        super().__init__()
        self.config = _config(model)
        num_layers = self.config.num_hidden_layers
        self.tp_mesh = tp_mesh
        decoder = _decoder(model)
        # A ModuleDict keyed by the layer's index keeps the names "model.layers.<i>.*".
        decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layer_ids})
        if layer_ids.start > 0:
            decoder.embed_tokens = None
        if layer_ids.stop < num_layers:
            decoder.norm = None
        self.model: Any = decoder
        self.lm_head: Any = model.lm_head if layer_ids.stop == num_layers else None

    def forward(self, h: Tensor) -> Tensor:
        """Token ids [b, l] (first stage) or hidden states [b, l, H] -> hidden states, or logits
        [b, l, V] on the last stage."""
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


def split_pipeline_stage(
    model: nn.Module, *, pp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None
) -> nn.Module:
    """This rank's pipeline stage of `model`: an equal share of the decoder layers (in order).

    `model` is consumed: the stage takes its modules and the rest is dropped.
    """
    num_layers = _config(model).num_hidden_layers
    stage, num_stages = pp_mesh.get_local_rank(), pp_mesh.size()
    layer_ids = range(stage * num_layers // num_stages, (stage + 1) * num_layers // num_stages)
    return _PipelineStageModule(model, layer_ids, tp_mesh=tp_mesh)


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


def _sum_gradients(model: nn.Module) -> None:
    """Make every FSDP/replicate group sum gradients over its data axes instead of averaging:
    each rank's loss is already its share of the global loss (module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
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
    for layer in _layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    _sum_gradients(model)


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


class ParallelModel:
    """One rank's part of a parallelised model, and how a training step runs on it.

    A step is `forward_backward` (once per batch, or several times to accumulate), then
    `reduce_tied_grads`, then the optimiser over `parameters()`.
    """

    def __init__(
        self,
        module: nn.Module,
        dims: ParallelDims,
        mesh: DeviceMesh,
        *,
        pp_micro_batch_size: int = 1,
        tied_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module, self.dims, self.mesh = module, dims, mesh
        self.pp_micro_batch_size = pp_micro_batch_size
        self._tied_group = tied_group
        self._schedules: dict[int, object] = {}
        self._stage: object | None = None
        self._loss_fn: LossFn | None = None
        if dims.pp > 1:
            from torch.distributed.pipelining import PipelineStage

            device = next(module.parameters()).device
            self._stage = PipelineStage(
                module,
                mesh["pp"].get_local_rank(),
                dims.pp,
                device,
                group=mesh["pp"].get_group(),
            )

    @property
    def dp_rank(self) -> int:
        """Which of the `dims.dp` shares of the batch's rows this rank takes."""
        return self.mesh["dp"].get_local_rank()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (DTensors where sharded), for the optimiser."""
        return self.module.parameters()

    def forward_backward(self, input_ids: Tensor, labels: Tensor, loss_fn: LossFn) -> Tensor:
        """Forward and backward of this rank's rows; returns the global batch's loss.

        `input_ids` [b, l] are this rank's rows (`dp_rank`), all of their columns; `labels`
        [b, l, ...] is any per-token tensor aligned with them (e.g. the next token ids), cut the
        same way as the inputs (micro-batches under PP, sequence shards under CP) before
        `loss_fn(logits, labels)` sees it. The returned loss is summed over micro-batches,
        sequence shards and data-parallel ranks, the same on every rank.
        """
        if self._stage is not None:
            loss = self._pipeline_step(input_ids, labels, loss_fn)
        elif self.dims.cp > 1:
            loss = self._context_parallel_step(input_ids, labels, loss_fn)
        else:
            logits = self.module(input_ids=input_ids, use_cache=False).logits
            loss = loss_fn(logits, labels)
            loss.backward()
        loss = loss.detach().clone()
        if self.dims.pp > 1:  # only the last stage has it; the others hold 0
            dist.all_reduce(loss, group=self.mesh["pp"].get_group())
        dist.all_reduce(loss, group=self.mesh["dp_cp"].get_group())
        return loss

    def _pipeline_step(self, input_ids: Tensor, labels: Tensor, loss_fn: LossFn) -> Tensor:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        size = self.pp_micro_batch_size
        if input_ids.shape[0] % size:
            raise ValueError(
                f"{KEY}.pp_micro_batch_size ({size}) must divide the rows per data-parallel rank "
                f"({input_ids.shape[0]})"
            )
        num_micro_batches = input_ids.shape[0] // size
        schedule = self._schedules.get(num_micro_batches)
        if schedule is None:
            # 1F1B holds fewer micro-batches' activations but needs one per stage at least.
            kind = Schedule1F1B if num_micro_batches >= self.dims.pp else ScheduleGPipe
            schedule = kind(
                self._stage,  # type: ignore[arg-type]
                num_micro_batches,
                loss_fn=lambda logits, target: self._loss_fn(logits, target),  # type: ignore[misc]
                scale_grads=False,  # the shares of the global loss already add up
            )
            self._schedules[num_micro_batches] = schedule
        self._loss_fn = loss_fn
        stage = self.mesh["pp"].get_local_rank()
        first, last = stage == 0, stage == self.dims.pp - 1
        losses: list[Tensor] = []
        args = (input_ids,) if first else ()
        schedule.step(  # type: ignore[attr-defined]
            *args, target=labels if last else None, losses=losses, return_outputs=False
        )
        if last:
            return torch.stack(losses).sum()
        return torch.zeros((), device=input_ids.device)

    def _context_parallel_step(self, input_ids: Tensor, labels: Tensor, loss_fn: LossFn) -> Tensor:
        from torch.distributed.tensor.experimental import context_parallel

        length = input_ids.shape[1]
        if length % (2 * self.dims.cp):
            raise ValueError(
                f"{KEY}.cp_size ({self.dims.cp}): sequence length {length} must be a multiple of "
                f"2 * cp_size (each rank takes one chunk from each end, for balance)"
            )
        # context_parallel shards its buffers in place: work on copies.
        input_ids, labels = input_ids.clone(), labels.clone()
        position_ids = torch.arange(length, device=input_ids.device).repeat(input_ids.shape[0], 1)
        buffers = [input_ids, labels, position_ids]
        with context_parallel(
            self.mesh["cp"],
            buffers=buffers,
            buffer_seq_dims=[1, 1, 1],
            no_restore_buffers=set(buffers),
        ):
            logits = self.module(
                input_ids=input_ids, position_ids=position_ids, use_cache=False
            ).logits
            loss = loss_fn(logits, labels)
            loss.backward()
        return loss

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of a tied embedding's two copies (first and last pipeline stage).
        Call once per optimiser step, after the last backward; a no-op without PP."""
        if self._tied_group is None:
            return
        stage = self.mesh["pp"].get_local_rank()
        module: Any = self.module
        weight = module.model.embed_tokens.weight if stage == 0 else module.lm_head.weight
        grad = weight.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            # Under TP the embedding's gradient comes back replicated while the head's is
            # sharded like the weight; the copies' local pieces must match to be summed.
            if grad.placements != weight.placements:
                grad = weight.grad = grad.redistribute(grad.device_mesh, weight.placements)
            grad = grad.to_local()
        dist.all_reduce(grad, group=self._tied_group)


def parallelize_model(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    pp_micro_batch_size: int = 1,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: Literal["always", "never", "default"] = "default",
    offload: bool = False,
) -> ParallelModel:
    """Split `model` (an HF causal LM, the same weights on every rank) over `mesh`, in place.

    The order is torchtitan's; each step needs what the previous one leaves. The last four
    arguments are `[train]`'s FSDP2 settings: the compute dtype (None: the parameters' own),
    `fsdp_reduce_dtype`, `fsdp_reshard_after_forward` and `fsdp_offload` (see `apply_fsdp`).
    """
    if offload and not dims.fsdp_enabled:
        raise ValueError(
            "train.fsdp_offload needs sharded parameters (policy.parallelism.dp_shard_size > 1)"
        )
    dims.check_model(_config(model))
    tied = _tied(model)
    tp_mesh = mesh["tp"] if dims.tp > 1 else None
    # 1. PP first: every later step applies to this rank's stage only.
    if dims.pp > 1:
        model = split_pipeline_stage(model, pp_mesh=mesh["pp"], tp_mesh=tp_mesh)
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
    # 5. Data parallel last: it wraps whatever the layers have become. CP ranks are FSDP ranks
    #    (dp_shard_cp): they hold different tokens, so their gradients are summed like DP's.
    if dims.fsdp_enabled:
        axes = ("dp_replicate", "dp_shard_cp") if dims.dp_replicate > 1 else ("dp_shard_cp",)
        apply_fsdp(
            model,
            mesh[axes],
            reshard_after_forward=reshard_after_forward,
            pipelined=dims.pp > 1,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            offload=offload,
        )
    elif dims.dp_replicate > 1:
        apply_ddp(model, mesh["dp_replicate"], param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # A tied embedding's copies live on the first and last stage; their gradients are summed
    # by ParallelModel.reduce_tied_grads.
    tied_group = _tied_embedding_group(mesh) if tied and dims.pp > 1 else None
    return ParallelModel(
        model, dims, mesh, pp_micro_batch_size=pp_micro_batch_size, tied_group=tied_group
    )
