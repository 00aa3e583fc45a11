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

The class is built in layers, a module of this package each, every one on the one before:
`state` (requests, prompts' blocks, per-slot tensors; the constructor), `finish` (completions,
freed slots), `multiturn` (parked samples, observations), `decode` (the decode step, sampling),
`admission` (admission, prefill); `TorchEngine`, here, adds the `Engine` hooks.

Why not transformers' own pieces: its StaticCache writes every row at one shared position (no
per-sequence lengths, so no continuous batching), and its ContinuousBatchingManager (paged cache)
updates each request in Python for every token, shares no prompt between samples and knows
nothing of policy versions. Without a paged-attention kernel (pure PyTorch, CPU and CUDA alike)
reading blocks costs a gather per step; BENCHMARKS.md measures what sharing the prompt wins back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nebula_rl.rollout.engine import Completion, GenerationRequest, RequestOutput
from nebula_rl.rollout.torch_engine.admission import _Admitting
from nebula_rl.rollout.torch_engine.fused import _FusedForward
from nebula_rl.rollout.torch_engine.state import _RequestState
from nebula_rl.weights.reshard import Box, full_box


class TorchEngine(_Admitting):
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

    @property
    def num_running(self) -> int:
        """Sequences decoding now."""
        return int(self._active_host.sum())

    @property
    def kv_cache_usage(self) -> tuple[int, int]:
        """(blocks holding keys and values, blocks of the cache but the reserved block 0)."""
        return self.cache.num_used, self.cache.num_blocks - 1
