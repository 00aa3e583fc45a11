"""Pipeline parallelism: a decoder cut into stages of whole layers (`split_pipeline`), the
stage modules, the schedules (`PP_SCHEDULES`) and the group of a tied embedding."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from nebula_rl.policy.parallelize.dims import KEY
from nebula_rl.policy.parallelize.structure import decoder_stack, model_config

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
    config = model_config(model)
    last = config.num_hidden_layers - 1
    mine = [(s, layers) for s, layers in enumerate(stage_layers) if s % pp == rank]
    layer_ids = [i for _, layers in mine for i in layers]
    decoder = decoder_stack(model)
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
        model_config(model).num_hidden_layers, pp=pp_mesh.size(), schedule="1F1B"
    )
    whole, _ = split_pipeline(model, layers, pp_mesh=pp_mesh, tp_mesh=tp_mesh)
    return whole


def tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
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
