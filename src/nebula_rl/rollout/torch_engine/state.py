"""What a `TorchEngine` holds: its requests, their samples and their prompts' blocks in the
paged cache, and per slot of the decode batch its tensors on the device and their host mirrors.
`_EngineState` builds it all; the engine's other parts build on it, each on the one before:
`finish`, `multiturn`, `decode`, `admission`, then `engine`."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

from nebula_rl.models import media_token_ids
from nebula_rl.rollout.engine import Completion, Engine, GenerationRequest
from nebula_rl.rollout.multimodal import is_multimodal
from nebula_rl.rollout.tensor_parallel import TensorParallel, shard_model
from nebula_rl.rollout.torch_engine.blocks import _BlockPool
from nebula_rl.rollout.torch_engine.fused import _Forward, _FusedForward
from nebula_rl.rollout.torch_engine.hf_forward import _HFForward
from nebula_rl.rollout.torch_engine.model import (
    _check_fp8,
    _lm_head,
    _ModelDims,
    fused_forward_unsupported,
)
from nebula_rl.weights.reshard import Box


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


class _EngineState(Engine):
    """The state of a `TorchEngine` (its arguments: see there), and the helpers every part of
    the engine uses."""

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
        self._init_cache(model, dims, block_size, num_kv_blocks, chunked_prefill, quantization)
        self._init_slots(seed, policy_version)

    def _init_cache(
        self,
        model: torch.nn.Module,
        dims: _ModelDims,
        block_size: int,
        num_kv_blocks: int | None,
        chunked_prefill: bool,
        quantization: Literal["none", "fp8"],
    ) -> None:
        """The paged KV cache (`_BlockPool`) and the forward that reads and writes it."""
        num_slots, max_len, device = self.max_num_seqs, self.max_model_len, self.device
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

    def _init_slots(self, seed: int, policy_version: int) -> None:
        """The per-slot state on the device, its host mirrors, and the bookkeeping of the
        requests, samples and prompts."""
        num_slots, max_len, device = self.max_num_seqs, self.max_model_len, self.device
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

    def _data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self._params.values()]

    def _completion_room(self, request: GenerationRequest) -> int:
        return min(request.sampling.max_tokens, self.max_model_len - len(request.prompt_token_ids))

    def _num_tokens(self, slot: int) -> int:
        """Tokens slot `slot` holds (sampled or appended): its cached ones and the last one."""
        return int(self._pos_host[slot] - self._prompt_len_host[slot]) + 1

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        """Block ids [len(rows), longest], block 0 past each row's own."""
        width = max(len(r) for r in rows)
        table = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return table.to(self.device)

    def _count_flags(self, request: GenerationRequest, sign: int) -> None:
        sampling = request.sampling
        self._flag_counts["top_k"] += sign * (0 < sampling.top_k < self.vocab_size)
        self._flag_counts["top_p"] += sign * (sampling.top_p < 1)
        self._flag_counts["greedy"] += sign * (sampling.temperature == 0)
        self._flag_counts["stop"] += sign * bool(sampling.stop)
        self._flag_counts["penalty"] += sign * (sampling.repetition_penalty != 1)
