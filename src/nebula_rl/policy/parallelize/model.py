"""The composition: `parallelize_model` applies one `apply_*` per parallelism in torchtitan's
order and returns a `ParallelModel`, which runs a batch the way the layout needs (plain, a
pipeline schedule, or each sequence split over the CP ranks), and the whole-model loss and
gradient norm."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from nebula_rl.models import media_token_ids
from nebula_rl.policy.parallelize.dims import LossFn, ParallelDims
from nebula_rl.policy.parallelize.pipeline import (
    pipeline_stage_layers,
    split_pipeline,
    tied_embedding_group,
)
from nebula_rl.policy.parallelize.structure import (
    model_config,
    tied_embeddings,
    vision_blocks,
    vision_modules,
)
from nebula_rl.policy.parallelize.tensor_parallel import apply_tp
from nebula_rl.policy.parallelize.wrap import (
    apply_ac,
    apply_compile,
    apply_ddp,
    apply_fsdp,
    shard_vision_over_tp,
    sum_gradients,
)
from nebula_rl.utils.sequence_split import GatheredAttention

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
        if never := media_token_ids(model_config(module)):  # (as the rollout engine samples)
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
    hf_config: Any = model_config(module)
    config = hf_config.vision_config
    merge = int(config.spatial_merge_size)
    channels = getattr(config, "in_channels", None) or config.num_channels  # (SigLIP2's name)
    width = int(channels * getattr(config, "temporal_patch_size", 1) * config.patch_size**2)
    given = dict(inputs or {})
    missing = [
        (kind, token, pixels, grid)
        for kind, token, pixels, grid in (
            (1, hf_config.image_token_id, "pixel_values", "image_grid_thw"),
            (2, hf_config.video_token_id, "pixel_values_videos", "video_grid_thw"),
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
        start, end = hf_config.vision_start_token_id, hf_config.vision_end_token_id
        ids[rows, 3 * i : 3 * i + 3] = torch.tensor([start, token, end])
        types[rows, 3 * i + 1] = kind
        given[pixels] = torch.zeros(merge * merge, width, device=device)
        given[grid] = torch.tensor([[1, merge, merge]], device=device)
    return ids, {**given, "mm_token_type_ids": types}


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
        self._touch_vision = dims.dp > 1 and vision_blocks(module) != []
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
    dims.check_model(model_config(model))
    config = model_config(model).get_text_config()  # (a vision-language model's language model)
    tied = tied_embeddings(model)
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
    if tp_mesh is not None and vision_blocks(model):
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
    if tp_mesh is not None and vision_blocks(model):
        for module in vision_modules(model):
            sum_gradients(module, divide=float(dims.tp))
    data_parallel = dims.fsdp_enabled or dims.dp_replicate > 1
    # A tied embedding's copies live on the first and last stage; their gradients are summed
    # by ParallelModel.reduce_tied_grads.
    tied_group = tied_embedding_group(mesh) if tied and dims.pp > 1 else None
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
