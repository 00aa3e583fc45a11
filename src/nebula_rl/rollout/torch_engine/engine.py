"""The built-in generation engine: continuous batching over a paged KV cache whose prompt
blocks a GRPO group shares.

It runs the Hugging Face model object the policy trains (same class, same parameter names), so
`update_weights` copies tensors into it by name, in place.

Design, and the simplifications it makes:

- Paged cache. Keys and values live in blocks of `block_size` tokens (`_BlockPool`). A prompt is
  prefilled once per request, whatever its `n`, into blocks of its own that all of its samples
  read; each sample's generated tokens go to blocks of its own, taken one at a time as it grows
  and given back when it finishes (the prompt's when its last sample does). Memory follows the
  real lengths: a group of n samples holds one prompt plus n completions, not n copies of
  prompt + max_model_len. Admission reserves the blocks of each sample's whole completion
  (`max_tokens`, capped by max_model_len), so decoding never runs out and nothing is preempted;
  samples that do not fit wait for blocks to come back.
- One step = one token for every running sequence: a batched decode forward, then the admission
  of waiting requests, whose prompts are prefilled together (right-padded, grouped by length;
  causal attention never lets a real token see the padding) and which sample their first token
  in the same step. With `chunked_prefill`, a prompt longer than `max_num_batched_tokens` is
  prefilled in chunks of that size, one per step, while the running sequences keep decoding.
- Decode attention (`_paged_attention`) gathers each sequence's own blocks into warm buffers,
  and scores a prompt's blocks once for all of its sequences in the step (their queries stacked
  in one matmul), then one softmax over both parts. The prompt's gathered blocks are kept
  between steps while the running set does not change.
- Forward. For the Llama family (llama, mistral, qwen2, qwen3) a compact forward reads the HF
  module's own parameters and does per step what `generate` does through module calls and cache
  objects. It runs q/k/v and gate/up as one matmul each: the engine concatenates them once and
  re-points the HF parameters at slices of the result, so they stay the model's parameters (same
  objects, same names) and in-place updates reach the fused weights. Tests check it token for
  token against the HF forward. Any other causal LM, or one whose projections are not plain
  nn.Linear (LoRA, quantized), runs the HF modules themselves over the same paged cache, each
  layer handed its sequences' blocks gathered (`forward="hf"` forces that path).
- Sampling happens on the device for the whole batch (see `sampling.py`); per step the host does
  a constant amount of work per batch, plus some per finished sequence or new block, plus, only
  for requests with stop strings, a detokenization of the last few tokens. One device->host
  sync per step.
- Multi-turn (`GenerationRequest.continuation`): a sample that stops hands its tokens to the
  continuation and waits, out of the decode batch, its blocks kept. The observation that comes
  back runs through the model in one forward (`extend`): its keys and values go into the
  sample's own blocks, attending to the prompt's and its own cached tokens, and it is recorded
  with log-prob 0; the sample then decodes on from the observation's last token in the same
  step. The prefix is never run again.
- Weight updates land between steps (see `Engine`). Running sequences keep their KV cache: tokens
  after an update are sampled by the new weights attending to keys/values the old ones computed,
  as in PipelineRL's in-flight updates; the per-token versions record exactly that. The engine
  logs (step, version) and each finished completion derives its change points from that log.

Why not transformers' own pieces: its StaticCache writes every row at one shared position (no
per-sequence lengths, so no continuous batching), and its ContinuousBatchingManager (paged cache)
updates each request in Python for every token, shares no prompt between samples and knows
nothing of policy versions. Without a paged-attention kernel (pure PyTorch, CPU and CUDA alike)
reading blocks costs a gather per step; BENCHMARKS.md measures what sharing the prompt wins back.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

from nebula_rl.models import media_token_ids
from nebula_rl.rollout.engine import (
    Completion,
    Engine,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    version_changes_for,
)
from nebula_rl.rollout.multimodal import (
    PromptEmbeddings,
    embed_prompts,
    is_multimodal,
)
from nebula_rl.rollout.sampling import BatchSampling, sample
from nebula_rl.rollout.tensor_parallel import TensorParallel, shard_model
from nebula_rl.rollout.torch_engine.blocks import _BlockPool, _DecodeBatch
from nebula_rl.rollout.torch_engine.fused import _Forward, _FusedForward, _Past
from nebula_rl.rollout.torch_engine.hf_forward import _HFForward
from nebula_rl.rollout.torch_engine.model import (
    _check_fp8,
    _lm_head,
    _ModelDims,
    fused_forward_unsupported,
)
from nebula_rl.weights.reshard import Box, full_box


@dataclass(eq=False)
class _RequestState:
    request: GenerationRequest
    completions: list[Completion | None]
    next_index: int = 0
    num_done: int = 0
    slots: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Sequence:
    state: _RequestState
    index: int
    first_step: int
    stop: tuple[str, ...]
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    """Multi-turn: (first token index, its step, held) of each run of tokens after the first:
    its first `held` + 1 tokens (an observation and the token sampled after it) come at that
    step, the rest one per step (a sample waiting for its continuation makes no tokens)."""
    observations: list[tuple[int, int]] = field(default_factory=list)
    """Multi-turn: the [start, end) token ranges appended by the continuation."""


# (request state, sample indices, slots) of samples admitted together.
_Admission = tuple[_RequestState, list[int], list[int]]


@dataclass(eq=False)
class _Prefix:
    """A prompt's blocks in the paged cache, read by the samples admitted with it."""

    blocks: list[int]
    length: int
    users: int
    """Slots still reading it; its blocks go back when the last one finishes."""


@dataclass(eq=False)
class _Chunking:
    """A prompt prefilled in chunks, one per step."""

    entry: _Admission
    prefix: int
    done: int = 0
    """Prompt tokens prefilled so far."""


def _eos_token_ids(model: torch.nn.Module, vocab_size: int) -> tuple[int, ...]:
    """The model's eos token id(s), from its generation config, else its config."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return tuple(int(t) for t in ids if 0 <= t < vocab_size)


class TorchEngine(Engine):
    """Continuous-batching generation engine on plain PyTorch, for any HF causal LM.

    Args:
        model: an HF `*ForCausalLM` (on the device and dtype to generate with). The engine owns
            it: it is put in eval mode, gradients off; `update_weights` writes into it by name.
        max_num_seqs: the most sequences decoded together.
        max_model_len: longest prompt + completion, in tokens (default: the model's
            max_position_embeddings).
        max_num_batched_tokens: most (padded) prompt tokens prefilled in one step.
        block_size: tokens per block of the paged KV cache.
        num_kv_blocks: blocks of the KV cache (default: room for max_num_seqs x max_model_len
            tokens; sequences use what they need, so shorter ones leave room for more).
        chunked_prefill: prefill a prompt longer than max_num_batched_tokens in chunks of at
            most that many tokens (whole blocks, at least one), one per step, decoding the
            running sequences in between (text prompts; a multimodal prompt is prefilled whole).
        tokenizer: anything with `decode(list[int]) -> str`; needed only for stop strings.
        seed: seeds the engine's generator (used by requests without a seed).
        policy_version: the version of the weights the model starts with.
        forward: "auto" (compact forward where supported, else HF modules), "fused" or "hf".
        tensor_parallel: run as one rank of a tensor-parallel replica (see `tensor_parallel.py`):
            `model` is given whole and cut to this rank's slices here; every rank of the group
            must be fed the same requests, weight updates and seed, in the same order. Needs the
            compact forward.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 8192,
        block_size: int = 32,
        num_kv_blocks: int | None = None,
        chunked_prefill: bool = False,
        tokenizer: Any = None,
        seed: int = 0,
        policy_version: int = 0,
        forward: Literal["auto", "fused", "hf"] = "auto",
        tensor_parallel: TensorParallel | None = None,
        quantization: Literal["none", "fp8"] = "none",
    ) -> None:
        super().__init__(policy_version=policy_version)
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        dims = _ModelDims.of(model)
        limit = dims.max_position_embeddings
        if max_model_len is None:
            if limit is None:
                raise ValueError("max_model_len is required: the model config has no limit")
            max_model_len = limit
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.model = model.eval().requires_grad_(False)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tokenizer = tokenizer
        self.vocab_size = _lm_head(model).get_parameter("weight").shape[0]
        self.eos_token_ids = _eos_token_ids(model, self.vocab_size)

        if forward not in ("auto", "fused", "hf"):
            raise ValueError(f"forward must be 'auto', 'fused' or 'hf', got {forward!r}")
        reason = fused_forward_unsupported(model, self.max_model_len)
        if forward == "fused" and reason is not None:
            raise ValueError(f"forward='fused' is not available for this model: {reason}")
        self.forward_impl = "hf" if forward == "hf" or reason is not None else "fused"
        self.tensor_parallel = (
            tensor_parallel if tensor_parallel and tensor_parallel.size > 1 else None
        )
        self._tp_boxes: dict[str, tuple[tuple[int, ...], Box]] | None = None
        if self.tensor_parallel is not None:
            if self.forward_impl != "fused":
                raise ValueError(
                    "tensor parallelism needs the compact forward (Llama-family models, "
                    f"forward='auto' or 'fused'): {reason or 'forward=hf was asked for'}"
                )
            self._tp_boxes = shard_model(model, self.tensor_parallel)
            size = self.tensor_parallel.size
            dims = replace(
                dims, num_heads=dims.num_heads // size, num_kv_heads=dims.num_kv_heads // size
            )
        if quantization not in ("none", "fp8"):
            raise ValueError(f"quantization must be 'none' or 'fp8', got {quantization!r}")
        if quantization == "fp8":
            _check_fp8(model, self.device, self.forward_impl, reason)
        self.quantization = quantization
        self.multimodal = is_multimodal(model)
        config: Any = model.config
        self._never = torch.tensor(media_token_ids(config), dtype=torch.long, device=self.device)
        """Token ids never sampled (`models.media_token_ids`)."""
        self._params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self._params.update(model.named_buffers(remove_duplicate=False))
        self._storage = self._data_ptrs()

        num_slots, max_len, device = max_num_seqs, self.max_model_len, self.device
        self.block_size = block_size
        self._max_blocks = -(-max_len // block_size)
        """Blocks of the longest sequence."""
        if num_kv_blocks is None:
            num_kv_blocks = num_slots * self._max_blocks + 2
        if num_kv_blocks < self._max_blocks + 2:  # (+1 for a prompt's last part-filled block)
            raise ValueError(
                f"num_kv_blocks = {num_kv_blocks} cannot hold one sequence of max_model_len = "
                f"{max_len} tokens (block_size {block_size}): at least {self._max_blocks + 2}"
            )
        self.chunked_prefill = chunked_prefill
        self.cache = _BlockPool(
            num_layers=dims.num_layers,
            num_blocks=num_kv_blocks,
            block_size=block_size,
            num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
            dtype=self.dtype,
            device=device,
        )
        with torch.no_grad():
            self._forward: _Forward = (
                _FusedForward(
                    model, dims, self.cache, max_len, self.tensor_parallel, quantization == "fp8"
                )
                if self.forward_impl == "fused"
                else _HFForward(model, dims, self.cache)
            )
        with torch.inference_mode():
            # Per-slot state, on the device.
            self._last_token = torch.zeros(num_slots, dtype=torch.long, device=device)
            self._pos = torch.zeros(num_slots, dtype=torch.long, device=device)
            # Rotary offset after a multimodal prompt (0 for text): see `multimodal.py`.
            self._rope_delta = torch.zeros(num_slots, dtype=torch.long, device=device)
            self._num_generated = torch.zeros(num_slots, dtype=torch.long, device=device)
            self._max_new = torch.ones(num_slots, dtype=torch.long, device=device)
            self._active = torch.zeros(num_slots, dtype=torch.bool, device=device)
            self._inv_temperature = torch.ones(num_slots, device=device)
            self._top_k = torch.full((num_slots,), self.vocab_size, dtype=torch.long, device=device)
            self._top_p = torch.ones(num_slots, device=device)
            self._greedy = torch.zeros(num_slots, dtype=torch.bool, device=device)
            self._penalty = torch.ones(num_slots, device=device)
            self._stop_ids = torch.full((num_slots, 1), -1, dtype=torch.long, device=device)
            self._uniform = torch.zeros(num_slots, max_len, device=device)
            self._out_tokens = torch.zeros(num_slots, max_len, dtype=torch.long, device=device)
            self._out_logprobs = torch.zeros(num_slots, max_len, device=device)
        self._generator = torch.Generator(device=device).manual_seed(seed)
        # Blocks of each slot's generated tokens (block 0 past its own).
        self._own_table = torch.zeros(num_slots, self._max_blocks, dtype=torch.long, device=device)
        # Host mirrors and bookkeeping.
        self._active_host = np.zeros(num_slots, dtype=bool)
        self._pos_host = np.zeros(num_slots, dtype=np.int64)
        self._prompt_len_host = np.zeros(num_slots, dtype=np.int64)
        self._own_blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self._promised = np.zeros(num_slots, dtype=np.int64)
        """Blocks reserved for a slot's completion and not taken yet."""
        self._prefix_of = np.zeros(num_slots, dtype=np.int64)
        """The prompt (`_prefixes` key) each slot continues."""
        self._prefixes: dict[int, _Prefix] = {}
        self._next_prefix = 0
        self._chunking: deque[_Chunking] = deque()
        """Admitted prompts whose prefill runs in chunks, the first one in progress."""
        self._groups: (
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None
        ) = None
        """The decode batch's grouping by prompt, while the active slots stay the same."""
        self._own_layout: tuple[object, int, object] | None = None
        """(grouping, own block columns, key): the key of `_DecodeBatch.own_key`."""
        self._top_k_host = np.zeros(num_slots, dtype=np.int64)  # 0 where top-k is off
        self._seqs: list[_Sequence | None] = [None] * num_slots
        self._free = list(range(num_slots))
        self._waiting: deque[_RequestState] = deque()
        self._requests: dict[str, _RequestState] = {}
        self._flag_counts = {"top_k": 0, "top_p": 0, "greedy": 0, "stop": 0, "penalty": 0}
        # [num_slots, vocab] bool, the tokens in each slot's sequence: allocated by the first
        # request with a repetition penalty, kept up to date only while one runs.
        self._seen: torch.Tensor | None = None
        self._step_count = 0
        self._version_log: list[tuple[int, int]] = [(0, policy_version)]
        self._parked: dict[int, Future[list[int] | None]] = {}
        """Multi-turn: slots waiting for their continuation, out of the decode batch."""

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        **kwargs: Any,
    ) -> TorchEngine:
        """Load an HF checkpoint (or hub name) and build an engine on it."""
        from nebula_rl.models import load_model

        return cls(load_model(path, dtype=dtype, device=device), **kwargs)

    def tp_boxes(self) -> dict[str, tuple[tuple[int, ...], Box]]:
        """Per parameter name: the full tensor's shape and the box of it this rank holds (the
        whole tensor without tensor parallelism). What `weights.reshard.ShardedReceiver` needs."""
        if self._tp_boxes is not None:
            return dict(self._tp_boxes)
        return {
            name: (tuple(p.shape), full_box(p.shape)) for name, p in self.model.named_parameters()
        }

    def rng_state(self) -> torch.Tensor:
        """State of the sampling generator (used by requests without a seed), for checkpoints."""
        return self._generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore the sampling generator from :meth:`rng_state`."""
        self._generator.set_state(state)

    # ------------------------------------------------------------------ Engine hooks
    def validate(self, request: GenerationRequest) -> None:
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(request.prompt_token_ids)} tokens "
                f"leaves no room to generate within max_model_len={self.max_model_len}"
            )
        if request.sampling.stop and self.tokenizer is None:
            raise ValueError(f"request {request.request_id!r} uses stop strings: pass a tokenizer")
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: token id {bad[0]} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        if request.media is not None and not self.multimodal:
            config: Any = self.model.config
            raise ValueError(
                f"request {request.request_id!r} has images or videos, but the engine's model "
                f"({config.model_type}) is not a vision-language model"
            )
        if request.media is not None:
            self._check_media(request)

    def _check_media(self, request: GenerationRequest) -> None:
        """The prompt holds as many image and video tokens as its grids give embeddings."""
        assert request.media is not None
        config: Any = self.model.config
        merge = int(config.vision_config.spatial_merge_size) ** 2
        for kind, token_id, grid in (
            ("image", config.image_token_id, request.media.image_grid_thw),
            ("video", config.video_token_id, request.media.video_grid_thw),
        ):
            want = 0 if grid is None else int(grid.prod(-1).sum()) // merge
            have = sum(t == int(token_id) for t in request.prompt_token_ids)
            if have != want:
                raise ValueError(
                    f"request {request.request_id!r}: the prompt holds {have} {kind} tokens, its "
                    f"{kind} grids make {want}: the prompt ids and the pixels were not made "
                    "together"
                )

    def _add_request(self, request: GenerationRequest) -> None:
        assert request.request_id not in self._requests, "add_request() rejects duplicate ids"
        state = _RequestState(request, [None] * request.n)
        self._requests[request.request_id] = state
        self._waiting.append(state)

    def _num_unfinished(self) -> int:
        return len(self._requests)

    def _on_version_change(self) -> None:
        if self._version_log[-1][0] == self._step_count:
            self._version_log[-1] = (self._step_count, self._policy_version)
        else:
            self._version_log.append((self._step_count, self._policy_version))

    def _data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self._params.values()]

    def _weights_written(self) -> None:
        # A writer may re-point parameters at new storage instead of copying into them (a
        # zero-copy receiver): the fused tensors must follow.
        if (ptrs := self._data_ptrs()) != self._storage:
            if isinstance(self._forward, _FusedForward):
                self._forward.relink()  # (quantizes too)
            self._storage = ptrs
        elif isinstance(self._forward, _FusedForward) and self._forward.fp8:
            self._forward.requantize()

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Check every name and shape before copying anything: a bad update changes nothing.
        pairs = []
        for name, tensor in weights:
            target = self._params.get(name)
            if target is None:
                raise ValueError(f"update_weights: unknown parameter {name!r}")
            if target.shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            pairs.append((target, tensor))
        for target, tensor in pairs:
            target.copy_(tensor)  # in place: same storage, so nothing holding it goes stale

    def _abort(self, request_id: str) -> list[RequestOutput]:
        state = self._requests.get(request_id)
        if state is None:
            return []
        for chunking in [c for c in self._chunking if c.entry[0] is state]:
            self._chunking.remove(chunking)  # (admitted, not started: nothing generated)
            _, indices, slots = chunking.entry
            for index, slot in zip(indices, slots, strict=True):
                self._abort_unstarted(state, index)
                self._prefix_of[slot] = chunking.prefix
                self._give_back(slot)
        if state.next_index < state.request.n:
            self._waiting.remove(state)
        for index in range(state.next_index, state.request.n):
            self._abort_unstarted(state, index)
        state.next_index = state.request.n
        if state.slots:
            slots = sorted(state.slots)
            with torch.inference_mode():
                return self._complete(slots, ["abort"] * len(slots))
        del self._requests[request_id]
        return [self._output(state)]

    def _abort_unstarted(self, state: _RequestState, index: int) -> None:
        """Sample `index` of `state` ends aborted before its first token."""
        state.completions[index] = Completion(
            state.request.request_id, index, [], [], "abort", ((0, self._policy_version),)
        )
        state.num_done += 1

    def _step(self) -> list[RequestOutput]:
        with torch.inference_mode():
            outputs = []
            answered = self._answered()
            if answered:
                outputs += self._resume(answered)
            if self._active_host.any():
                outputs += self._decode()
            if self._chunking:  # (one chunk per step; admissions wait for the last)
                outputs += self._prefill_chunk()
            elif self._waiting and self._free:
                outputs += self._admit()
            self._step_count += 1
            return outputs

    # ------------------------------------------------------------------ decode
    def _decode(self) -> list[RequestOutput]:
        active = np.flatnonzero(self._active_host)
        size = self.block_size
        written = self._pos_host[active] - self._prompt_len_host[active]  # (generated, cached)
        starts = written % size == 0  # this step's token begins a new block
        if starts.any():
            grow = active[starts].tolist()
            blocks = self.cache.take(len(grow))
            for slot, block in zip(grow, blocks, strict=True):
                self._promised[slot] -= 1
                self._own_blocks[slot].append(block)
            rows = torch.as_tensor(grow, device=self.device)
            cols = torch.as_tensor(written[starts] // size, device=self.device)
            self._own_table[rows, cols] = torch.as_tensor(blocks, device=self.device)
        slots, batch = self._decode_batch(active, written + 1)
        positions = self._pos[slots]
        rope = positions + self._rope_delta[slots] if self.multimodal else None
        logits = self._forward.decode(self._last_token[slots], positions, batch, rope)
        self._pos[slots] = positions + 1
        self._pos_host[active] += 1
        return self._sample_and_record(logits, slots)

    def _decode_batch(
        self, active: np.ndarray, own_len: np.ndarray
    ) -> tuple[torch.Tensor, _DecodeBatch]:
        """The slots of `active` and where they read and write; `own_len`: their generated
        tokens in the cache once this step's is written."""
        device, size = self.device, self.block_size
        if self._groups is None:  # (the active slots changed: group them by prompt again)
            ids = self._prefix_of[active]
            unique, rows = np.unique(ids, return_inverse=True)
            members = np.zeros(len(active), dtype=np.int64)
            counts = np.zeros(len(unique), dtype=np.int64)
            for row, g in enumerate(rows.tolist()):
                members[row] = counts[g]
                counts[g] += 1
            prefixes = [self._prefixes[int(i)] for i in unique]
            table = self._block_table([p.blocks for p in prefixes])
            lengths = torch.tensor([p.length for p in prefixes], device=device)
            self._groups = (
                torch.as_tensor(active, device=device),
                table,
                self._length_mask(lengths, table.shape[1])[torch.as_tensor(rows, device=device)],
                torch.as_tensor(rows, device=device),
                torch.as_tensor(members, device=device),
                int(counts.max()),
            )
        slots, prefix_table, prefix_mask, group, member, width = self._groups
        count = -(-int(own_len.max()) // size)
        own_table = self._own_table[slots, :count]
        lengths = torch.as_tensor(own_len, device=device)
        mask = torch.cat([prefix_mask, self._length_mask(lengths, count)], dim=1)
        last = lengths - 1
        column, offset = last // size, last % size
        blocks = own_table.gather(1, column[:, None])[:, 0]
        layout = self._own_layout
        if layout is None or layout[0] is not self._groups or layout[1] != count:
            layout = self._own_layout = (self._groups, count, object())
        sequences = torch.arange(len(own_len), device=device)
        batch = _DecodeBatch(
            own_table=own_table,
            mask=mask[:, None, None],
            write=self.cache.write_index(blocks, offset),
            own_key=layout[2],
            own_write=self.cache.write_index(sequences * count + column, offset),
            prefix_table=prefix_table,
            group=group,
            member=member,
            width=width,
        )
        return slots, batch

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        """Block ids [len(rows), longest], block 0 past each row's own."""
        width = max(len(r) for r in rows)
        table = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return table.to(self.device)

    def _length_mask(self, lengths: torch.Tensor, count: int) -> torch.Tensor:
        """[N, count * block]: 0 at the first lengths[i] tokens of row i's blocks, the most
        negative value of the model's dtype after (added to attention scores)."""
        positions = torch.arange(count * self.block_size, device=self.device)
        mask = torch.zeros(len(lengths), len(positions), dtype=self.dtype, device=self.device)
        return mask.masked_fill_(positions >= lengths[:, None], torch.finfo(self.dtype).min)

    def _sample_and_record(self, logits: torch.Tensor, slots: torch.Tensor) -> list[RequestOutput]:
        """Sample one token per row of logits for `slots`, append it, finish what is done."""
        if len(self._never):
            logits[:, self._never] = float("-inf")
        counts = self._flag_counts
        columns = self._num_generated[slots]
        params = BatchSampling(
            inv_temperature=self._inv_temperature[slots],
            top_k=self._top_k[slots],
            top_p=self._top_p[slots],
            greedy=self._greedy[slots],
            uniform=self._uniform[slots, columns],
            max_top_k=int(self._top_k_host.max()) if counts["top_k"] else 0,
            use_top_p=counts["top_p"] > 0,
            any_greedy=counts["greedy"] > 0,
        )
        if counts["penalty"]:
            assert self._seen is not None
            params = replace(
                params, repetition_penalty=self._penalty[slots], seen=self._seen[slots]
            )
        tokens, logprobs = sample(logits, params)
        if counts["penalty"]:
            assert self._seen is not None
            self._seen[slots, tokens] = True
        self._out_tokens[slots, columns] = tokens
        self._out_logprobs[slots, columns] = logprobs
        self._last_token[slots] = tokens
        active = self._active[slots]
        generated = columns + active
        self._num_generated[slots] = generated
        hit_stop = (self._stop_ids[slots] == tokens[:, None]).any(dim=-1)
        done = (hit_stop | (generated >= self._max_new[slots])) & active
        # The one device->host sync of the step.
        done_rows = done.nonzero().view(-1)
        finished = slots[done_rows].tolist()
        reasons: list[FinishReason] = [
            "stop" if s else "length" for s in hit_stop[done_rows].tolist()
        ]
        if counts["stop"]:
            self._check_stop_strings(slots.tolist(), finished, reasons)
        if any(self._continues(slot) for slot in finished):
            finished, reasons = self._park(finished, reasons)
        return self._complete(finished, reasons)

    # ------------------------------------------------------------------ multi-turn
    def _continues(self, slot: int) -> bool:
        seq = self._seqs[slot]
        return seq is not None and seq.state.request.continuation is not None

    def _num_tokens(self, slot: int) -> int:
        """Tokens slot `slot` holds (sampled or appended): its cached ones and the last one."""
        return int(self._pos_host[slot] - self._prompt_len_host[slot]) + 1

    def _park(
        self, finished: list[int], reasons: list[FinishReason]
    ) -> tuple[list[int], list[FinishReason]]:
        """Hand the samples that stopped and have a continuation their tokens, take them out of
        the decode batch (blocks kept); the finished slots and reasons that remain."""
        keep_slots: list[int] = []
        keep_reasons: list[FinishReason] = []
        for slot, reason in zip(finished, reasons, strict=True):
            seq = self._seqs[slot]
            continuation = None if seq is None else seq.state.request.continuation
            if reason != "stop" or seq is None or continuation is None:
                keep_slots.append(slot)
                keep_reasons.append(reason)
                continue
            tokens = self._out_tokens[slot, : self._num_tokens(slot)].tolist()
            self._parked[slot] = continuation(seq.index, tokens)
            self._active_host[slot] = False
            self._active[slot] = False
            self._groups = None
        return keep_slots, keep_reasons

    def _answered(self) -> list[tuple[int, list[int] | None]]:
        """The parked samples whose continuation has answered, taken out of the parked ones,
        with their answers (waiting a moment for one when nothing else can run)."""
        if not self._parked:
            return []
        ready = [slot for slot, future in self._parked.items() if future.done()]
        if not ready and not self._active_host.any() and not (self._waiting and self._free):
            wait(list(self._parked.values()), timeout=0.005, return_when=FIRST_COMPLETED)
            ready = [slot for slot, future in self._parked.items() if future.done()]
        return [(slot, self._parked.pop(slot).result()) for slot in ready]

    def _resume(self, answered: list[tuple[int, list[int] | None]]) -> list[RequestOutput]:
        """Samples whose continuation answered (slot, observation): append the observation and
        decode on, or finish ("length" when the observation and one more token do not fit)."""
        finished: list[int] = []
        reasons: list[FinishReason] = []
        for slot, observation in answered:
            seq = self._seqs[slot]
            assert seq is not None
            num = self._num_tokens(slot)
            request = seq.state.request
            room = min(request.sampling.max_tokens, self._completion_room(request))
            if not observation or num + len(observation) >= room:
                finished.append(slot)
                reasons.append("length" if observation else "stop")
                continue
            bad = [t for t in observation if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"an observation's token id {bad[0]} is outside the vocabulary")
            self._extend(slot, num, observation)
            seq.segments.append((num, self._step_count, len(observation)))
            seq.observations.append((num, num + len(observation)))
            self._active_host[slot] = True
            self._active[slot] = True
            self._groups = None
        return self._complete(finished, reasons)

    def _extend(self, slot: int, num: int, observation: list[int]) -> None:
        """Append `observation` to slot `slot`'s `num` tokens: one forward writes the keys and
        values of its last token and all but the observation's last (the one decode reads
        next, in this same step) into its own blocks; the observation is recorded with
        log-prob 0."""
        size, length, device = self.block_size, len(observation), self.device
        written = int(self._pos_host[slot] - self._prompt_len_host[slot])  # (own tokens cached)
        held, needed = len(self._own_blocks[slot]), -(-(written + length) // size)
        if needed > held:
            blocks = self.cache.take(needed - held)
            self._promised[slot] -= needed - held
            self._own_blocks[slot] += blocks
            self._own_table[slot, held:needed] = torch.tensor(blocks, device=device)
        appended = torch.tensor(observation, device=device)
        tokens = torch.cat([self._last_token[slot : slot + 1], appended[:-1]])
        index = torch.arange(written, written + length, device=device)
        write = self.cache.write_index(self._own_table[slot, index // size], index % size)
        positions = self._pos[slot] + torch.arange(length, device=device)
        prefix = self._prefixes[int(self._prefix_of[slot])]
        past = _Past(
            torch.tensor([prefix.blocks], device=device),
            prefix.length,
            self._own_table[slot : slot + 1, :needed],
            written + length,
        )
        rope = positions + self._rope_delta[slot] if self.multimodal else None
        self._forward.extend(tokens, positions, write, past, rope)
        self._out_tokens[slot, num : num + length] = appended
        self._out_logprobs[slot, num : num + length] = 0.0
        if self._seen is not None and self._flag_counts["penalty"]:
            self._seen[slot, appended] = True
        self._num_generated[slot] = num + length
        self._last_token[slot] = appended[-1]
        self._pos[slot] += length
        self._pos_host[slot] += length

    def _version_changes(self, seq: _Sequence, num: int) -> tuple[tuple[int, int], ...]:
        """The (token index, version) change points of `seq`'s `num` tokens."""
        if not seq.segments:
            return version_changes_for(self._version_log, seq.first_step, num)
        starts = [(0, seq.first_step, 0), *seq.segments]
        ends = [start for start, _, _ in seq.segments] + [num]
        changes: list[tuple[int, int]] = []
        for (start, step, held), end in zip(starts, ends, strict=True):
            count = max(1, end - start - held)
            for offset, version in version_changes_for(self._version_log, step, count):
                if not changes or changes[-1][1] != version:
                    changes.append((start + offset + (held if offset else 0), version))
        return tuple(changes)

    def _check_stop_strings(
        self,
        slots: list[int],
        finished: list[int],
        reasons: list[FinishReason],
    ) -> None:
        """Host-side stop-string check, only for sequences whose request has stop strings.

        A stop string completed by the last token of max_tokens makes the reason "stop", as a
        stop token does.
        """
        position = {slot: row for row, slot in enumerate(finished)}
        candidates = [
            (slot, seq)
            for slot in slots
            if (seq := self._seqs[slot]) is not None
            and seq.stop
            and (slot not in position or reasons[position[slot]] != "stop")
        ]
        if not candidates:
            return
        lengths = [self._num_tokens(slot) for slot, _ in candidates]
        index = torch.tensor([slot for slot, _ in candidates], device=self.device)
        rows = self._out_tokens[index, : max(lengths)].tolist()  # one device->host copy
        for (slot, seq), row, num in zip(candidates, rows, lengths, strict=True):
            window = max(len(s) for s in seq.stop) + 2  # tokens; each decodes to >= 1 char
            text = self.tokenizer.decode(row[max(0, num - window) : num])
            if not any(s in text for s in seq.stop):
                continue
            if slot in position:
                reasons[position[slot]] = "stop"
            else:
                finished.append(slot)
                reasons.append("stop")

    def _complete(self, slots: list[int], reasons: list[FinishReason]) -> list[RequestOutput]:
        """Turn finished slots into completions, free the slots; return finished requests."""
        if not slots:
            return []
        seqs = [self._seqs[s] for s in slots]
        assert all(seq is not None for seq in seqs), "finished slots are occupied"
        lengths = [self._num_tokens(s) for s in slots]
        for slot in slots:
            self._parked.pop(slot, None)  # (aborted while waiting for its continuation)
        index = torch.as_tensor(slots, device=self.device)
        width = max(lengths)
        tokens = self._out_tokens[index, :width].tolist()
        logprobs = self._out_logprobs[index, :width].tolist()
        self._active[index] = False
        self._pos[index] = 0
        self._num_generated[index] = 0
        outputs = []
        for row, (slot, seq, reason, num) in enumerate(
            zip(slots, seqs, reasons, lengths, strict=True)
        ):
            assert seq is not None
            state = seq.state
            state.completions[seq.index] = Completion(
                state.request.request_id,
                seq.index,
                tokens[row][:num],
                logprobs[row][:num],
                reason,
                self._version_changes(seq, num),
                tuple(seq.observations),
            )
            self._release(slot)
            state.slots.discard(slot)
            state.num_done += 1
            if state.num_done == state.request.n:
                del self._requests[state.request.request_id]
                outputs.append(self._output(state))
        return outputs

    def _release(self, slot: int) -> None:
        seq = self._seqs[slot]
        assert seq is not None
        self._count_flags(seq.state.request, -1)
        self._seqs[slot] = None
        self._active_host[slot] = False
        self._pos_host[slot] = 0
        self._top_k_host[slot] = 0
        self._give_back(slot)

    def _give_back(self, slot: int) -> None:
        """Free the slot, its blocks and what was promised to it; its prompt's blocks when it
        was the prompt's last reader."""
        self.cache.give_back(self._own_blocks[slot])
        self._own_blocks[slot] = []
        self.cache.unreserve(int(self._promised[slot]))
        self._promised[slot] = 0
        prefix = self._prefixes[int(self._prefix_of[slot])]
        prefix.users -= 1
        if prefix.users == 0:
            self.cache.give_back(prefix.blocks)
            del self._prefixes[int(self._prefix_of[slot])]
        self._groups = None
        heapq.heappush(self._free, slot)

    @property
    def num_running(self) -> int:
        """Sequences decoding now."""
        return int(self._active_host.sum())

    @property
    def kv_cache_usage(self) -> tuple[int, int]:
        """(blocks holding keys and values, blocks of the cache but the reserved block 0)."""
        return self.cache.num_used, self.cache.num_blocks - 1

    def _count_flags(self, request: GenerationRequest, sign: int) -> None:
        sampling = request.sampling
        self._flag_counts["top_k"] += sign * (0 < sampling.top_k < self.vocab_size)
        self._flag_counts["top_p"] += sign * (sampling.top_p < 1)
        self._flag_counts["greedy"] += sign * (sampling.temperature == 0)
        self._flag_counts["stop"] += sign * bool(sampling.stop)
        self._flag_counts["penalty"] += sign * (sampling.repetition_penalty != 1)

    @staticmethod
    def _output(state: _RequestState) -> RequestOutput:
        completions = [c for c in state.completions if c is not None]
        assert len(completions) == state.request.n, "every sample has finished"
        request = state.request
        return RequestOutput(request.request_id, tuple(request.prompt_token_ids), completions)

    # ------------------------------------------------------------------ admission + prefill
    def _completion_room(self, request: GenerationRequest) -> int:
        return min(request.sampling.max_tokens, self.max_model_len - len(request.prompt_token_ids))

    def _admit(self) -> list[RequestOutput]:
        """Move waiting samples into free slots, as many as the cache's free blocks hold with
        their whole completions (so decoding never runs out of blocks), prefill their prompts,
        sample first tokens."""
        entries: list[_Admission] = []
        num_tokens, size = 0, self.block_size
        while self._waiting and self._free:
            state = self._waiting[0]
            request = state.request
            length = len(request.prompt_token_ids)
            chunked = (
                self.chunked_prefill
                and length > self.max_num_batched_tokens
                and request.media is None
            )
            if entries and (chunked or num_tokens + length > self.max_num_batched_tokens):
                break
            prompt_blocks, per_sample = (
                -(-length // size),
                -(-self._completion_room(request) // size),
            )
            fits = (self.cache.num_free - prompt_blocks) // per_sample
            take = min(request.n - state.next_index, len(self._free), fits)
            if take < 1:
                break  # (blocks come back as running sequences finish)
            self.cache.reserve(prompt_blocks + take * per_sample)
            slots = [heapq.heappop(self._free) for _ in range(take)]
            self._promised[slots] = per_sample
            entry = (state, list(range(state.next_index, state.next_index + take)), slots)
            state.next_index += take
            if state.next_index == request.n:
                self._waiting.popleft()
            if chunked:
                self._chunking.append(_Chunking(entry, self._new_prefix(length, take)))
                return self._prefill_chunk()
            entries.append(entry)
            num_tokens += length
        if not entries:
            return []
        # Prefill prompts of similar lengths together, so padding wastes at most ~25% compute.
        entries.sort(key=lambda e: len(e[0].request.prompt_token_ids))
        outputs, group = [], [entries[0]]
        for entry in entries[1:]:
            real = sum(len(e[0].request.prompt_token_ids) for e in group)
            padded = len(entry[0].request.prompt_token_ids) * (len(group) + 1)
            if padded > 1.25 * (real + len(entry[0].request.prompt_token_ids)):
                outputs += self._prefill(group)
                group = []
            group.append(entry)
        return outputs + self._prefill(group)

    def _new_prefix(self, length: int, users: int) -> int:
        """Take the reserved blocks of a prompt of `length` tokens; its id."""
        key = self._next_prefix
        self._next_prefix += 1
        self._prefixes[key] = _Prefix(self.cache.take(-(-length // self.block_size)), length, users)
        return key

    def _prefill(self, group: list[_Admission]) -> list[RequestOutput]:
        """Prefill the prompts of `group` together (each once, whatever its samples), start
        their samples."""
        prefixes = [
            self._new_prefix(len(state.request.prompt_token_ids), len(slots))
            for state, _, slots in group
        ]
        longest = max(len(state.request.prompt_token_ids) for state, _, _ in group)
        prompts = torch.zeros(len(group), longest, dtype=torch.long)
        for row, (state, _, _) in enumerate(group):
            ids = state.request.prompt_token_ids
            prompts[row, : len(ids)] = torch.tensor(ids)
        last = torch.tensor([len(s.request.prompt_token_ids) - 1 for s, _, _ in group])
        slots_t, source = self._activate(group, prefixes)
        prompts, last = prompts.to(self.device), last.to(self.device)
        embedded = self._embed_media(group, prompts, last + 1, slots_t, source)
        # (the longest prompt's blocks set the width: the padding of shorter ones goes to block 0)
        table = self._block_table([self._prefixes[p].blocks for p in prefixes])
        logits = self._forward.prefill(prompts, last, table, 0, None, embedded)
        return self._sample_first(logits, slots_t, source, len(group))

    def _prefill_chunk(self) -> list[RequestOutput]:
        """The next chunk of the prompt being prefilled in chunks; its samples start after the
        last chunk."""
        chunking = self._chunking[0]
        state, _, _ = chunking.entry
        ids = state.request.prompt_token_ids
        size = self.block_size
        step = max(size, self.max_num_batched_tokens // size * size)
        start, end = chunking.done, min(len(ids), chunking.done + step)
        blocks = self._prefixes[chunking.prefix].blocks
        tokens = torch.tensor([ids[start:end]], device=self.device)
        table = torch.tensor([blocks[start // size : -(-end // size)]], device=self.device)
        past = torch.tensor([blocks[: start // size]], device=self.device) if start else None
        last = torch.tensor([end - start - 1], device=self.device)
        logits = self._forward.prefill(tokens, last, table, start, past)
        chunking.done = end
        if end < len(ids):
            return []
        self._chunking.popleft()
        slots_t, source = self._activate([chunking.entry], [chunking.prefix])
        self._rope_delta[slots_t] = 0
        return self._sample_first(logits, slots_t, source, 1)

    def _activate(
        self, group: list[_Admission], prefixes: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """Set up the slots of `group` (prefilled prompts `prefixes`) to decode: their slots,
        and for each the row of its prompt in the group."""
        all_slots, source, prompt_len, top_k, uniforms = [], [], [], [], []
        for row, ((state, indices, slots), prefix) in enumerate(zip(group, prefixes, strict=True)):
            request = state.request
            for index, slot in zip(indices, slots, strict=True):
                all_slots.append(slot)
                source.append(row)
                prompt_len.append(len(request.prompt_token_ids))
                top_k.append(
                    request.sampling.top_k if request.sampling.top_k < self.vocab_size else 0
                )
                self._seqs[slot] = _Sequence(state, index, self._step_count, request.sampling.stop)
                self._prefix_of[slot] = prefix
                state.slots.add(slot)
                self._count_flags(request, +1)
            uniforms.append(self._draw_uniforms(request, indices))
        slots_t = torch.tensor(all_slots, device=self.device)
        lengths = torch.tensor(prompt_len, device=self.device)
        self._set_slot_params(group, slots_t, lengths, torch.cat(uniforms))
        self._mark_prompt_tokens(group)
        self._active_host[all_slots] = True
        self._pos_host[all_slots] = prompt_len
        self._prompt_len_host[all_slots] = prompt_len
        self._top_k_host[all_slots] = top_k
        self._groups = None
        return slots_t, source

    def _sample_first(
        self, logits: torch.Tensor, slots: torch.Tensor, source: list[int], num_prompts: int
    ) -> list[RequestOutput]:
        """First tokens of `slots` from their prompts' logits (row source[i] for slot i)."""
        if len(source) > num_prompts:  # (a prompt's samples share its logits)
            logits = logits[torch.tensor(source, device=self.device)]
        return self._sample_and_record(logits, slots)

    def _embed_media(
        self,
        group: list[_Admission],
        prompts: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        source: list[int],
    ) -> PromptEmbeddings | None:
        """The group's prompt embeddings when one of them holds media (else None: text is
        embedded by the forward), and its slots' rotary offsets."""
        if not self.multimodal:
            return None
        media = [state.request.media for state, _, _ in group]
        if all(m is None for m in media):
            self._rope_delta[slots] = 0
            return None
        embedded = embed_prompts(self.model, prompts, lengths, media)
        self._rope_delta[slots] = embedded.deltas[torch.tensor(source, device=self.device)]
        if isinstance(self._forward, _FusedForward):
            self._forward.rope_room(self.max_model_len + max(0, int(embedded.deltas.max())))
        return embedded

    def _mark_prompt_tokens(self, group: list[_Admission]) -> None:
        """For requests with a repetition penalty: their slots' seen tokens are the prompt's."""
        penalised = [e for e in group if e[0].request.sampling.repetition_penalty != 1]
        if not penalised:
            return
        if self._seen is None:
            self._seen = torch.zeros(
                self.max_num_seqs, self.vocab_size, dtype=torch.bool, device=self.device
            )
        for state, _, slots in penalised:
            index = torch.tensor(slots, device=self.device)
            prompt = torch.tensor(state.request.prompt_token_ids, device=self.device)
            self._seen[index] = False
            self._seen[index[:, None], prompt[None, :]] = True

    def _draw_uniforms(self, request: GenerationRequest, indices: list[int]) -> torch.Tensor:
        """The uniforms each sample will sample its tokens with, [len(indices), max_model_len]."""
        shape = (len(indices), self.max_model_len)
        if request.sampling.seed is None:
            return torch.rand(shape, generator=self._generator, device=self.device)
        rows = []
        for index in indices:
            generator = torch.Generator(device=self.device).manual_seed(
                request.sampling.seed + index
            )
            rows.append(torch.rand(shape[1:], generator=generator, device=self.device))
        return torch.stack(rows)

    def _set_slot_params(
        self,
        batch: list[_Admission],
        slots: torch.Tensor,
        lengths: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> None:
        inv_temperature, top_k, top_p, greedy, max_new, stops = [], [], [], [], [], []
        penalty = []
        for state, indices, _ in batch:
            sampling = state.request.sampling
            room = self.max_model_len - len(state.request.prompt_token_ids)
            stop = list(sampling.stop_token_ids) + (
                [] if sampling.ignore_eos else list(self.eos_token_ids)
            )
            for _ in indices:
                inv_temperature.append(
                    1.0 / sampling.temperature if sampling.temperature > 0 else 1.0
                )
                top_k.append(
                    sampling.top_k if 0 < sampling.top_k < self.vocab_size else self.vocab_size
                )
                top_p.append(sampling.top_p)
                greedy.append(sampling.temperature == 0)
                penalty.append(sampling.repetition_penalty)
                max_new.append(min(sampling.max_tokens, room))
                stops.append(stop)
        width = max(1, *(len(s) for s in stops))
        if width > self._stop_ids.shape[1]:  # rare: grow the stop-id table
            grown = torch.full((self.max_num_seqs, width), -1, dtype=torch.long, device=self.device)
            grown[:, : self._stop_ids.shape[1]] = self._stop_ids
            self._stop_ids = grown
        stop_rows = torch.full((len(stops), self._stop_ids.shape[1]), -1, dtype=torch.long)
        for row, stop in enumerate(stops):
            stop_rows[row, : len(stop)] = torch.tensor(stop, dtype=torch.long)
        device = self.device
        self._inv_temperature[slots] = torch.tensor(inv_temperature, device=device)
        self._top_k[slots] = torch.tensor(top_k, device=device)
        self._top_p[slots] = torch.tensor(top_p, device=device)
        self._greedy[slots] = torch.tensor(greedy, device=device)
        self._penalty[slots] = torch.tensor(penalty, device=device)
        self._max_new[slots] = torch.tensor(max_new, device=device)
        self._stop_ids[slots] = stop_rows.to(device)
        self._uniform[slots] = uniforms
        self._pos[slots] = lengths
        self._num_generated[slots] = 0
        self._active[slots] = True
