"""vLLM behind the nebula-rl `Engine` interface, for machines where vLLM is installed.

Selected with `rollout.backend = "vllm"`; vLLM is imported inside this class only, so the rest of
nebula-rl (and its CPU tests) never imports it.

UNTESTED HERE: written for vLLM >= 0.10.2 (V1 engine; `logprobs_mode` appeared there) against its
public API (`LLMEngine.from_engine_args`, `add_request`, `step`, `abort_request`,
`collective_rpc`, `reset_prefix_cache`), without a GPU or vLLM to run it on; its test is marked
`gpu` and skips where vLLM is absent.

How it maps the interface:
- The engine core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so one `LLMEngine.step()`
  is one scheduler step and nothing generates between our steps. That is what makes the base
  class's boundary semantics (pause, update at the next step) hold for vLLM too.
- Log-probs: `SamplingParams(logprobs=0)` with `logprobs_mode="processed_logprobs"`, i.e. after
  temperature/top-k/top-p, the same definition as the built-in engine.
- Weights: `collective_rpc` runs `model.load_weights(named tensors)` on every worker (vLLM maps HF
  names, fusing q/k/v and gate/up itself), then the prefix cache is reset: cached KV from the
  old weights must not serve new prompts.
- Versions: outputs stream as deltas, so the engine knows each sample's token count at every step
  and records a change point for every running sample when an update lands.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from nebula_rl.rollout.engine import (
    Completion,
    Engine,
    FinishReason,
    GenerationRequest,
    RequestOutput,
)


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (collective_rpc passes the worker as first argument)."""
    worker.model_runner.model.load_weights(weights=weights)


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_changes: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _RequestState:
    request: GenerationRequest
    samples: list[_Sample]


class VLLMEngine(Engine):
    """Generation with vLLM (GPU), same interface and semantics as `TorchEngine`.

    Args:
        model: HF checkpoint directory or hub name (vLLM loads it itself).
        policy_version: the version of the weights in that checkpoint.
        dtype: vLLM dtype string.
        max_model_len: longest prompt + completion (default: the model's).
        engine_kwargs: passed to `vllm.EngineArgs` (tensor_parallel_size, gpu_memory_utilization, ...).
    """

    def __init__(
        self,
        model: str,
        *,
        policy_version: int = 0,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__(policy_version=policy_version)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import EngineArgs, LLMEngine

        args = EngineArgs(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )
        self._engine = LLMEngine.from_engine_args(args)
        self._states: dict[str, _RequestState] = {}

    def _sampling_params(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        return SamplingParams(
            n=request.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            repetition_penalty=s.repetition_penalty,
            max_tokens=s.max_tokens,
            stop_token_ids=list(s.stop_token_ids),
            stop=list(s.stop),
            ignore_eos=s.ignore_eos,
            seed=s.seed,
            logprobs=0,
            detokenize=bool(s.stop),  # token ids are the product; text only for stop strings
            output_kind=RequestOutputKind.DELTA,
        )

    def _add_request(self, request: GenerationRequest) -> None:
        if request.media is not None:  # (build_engine refuses vision-language models)
            raise ValueError(f"request {request.request_id!r}: media are not passed to vLLM yet")
        samples = [_Sample(version_changes=[(0, self._policy_version)]) for _ in range(request.n)]
        self._states[request.request_id] = _RequestState(request, samples)
        self._engine.add_request(
            request.request_id,
            {"prompt_token_ids": list(request.prompt_token_ids)},
            self._sampling_params(request),
        )

    def _num_unfinished(self) -> int:
        return len(self._states)

    def _step(self) -> list[RequestOutput]:
        finished = []
        for out in self._engine.step():
            state = self._states.get(out.request_id)
            if state is None:  # e.g. a delta for a request aborted meanwhile
                continue
            for delta in out.outputs:
                sample = state.samples[delta.index]
                sample.token_ids.extend(delta.token_ids)
                for token, logprobs in zip(delta.token_ids, delta.logprobs or [], strict=False):
                    sample.logprobs.append(logprobs[token].logprob)
                if delta.finish_reason is not None:
                    sample.finish_reason = delta.finish_reason
            if out.finished:
                finished.append(self._output(self._states.pop(out.request_id)))
        return finished

    def _abort(self, request_id: str) -> list[RequestOutput]:
        state = self._states.pop(request_id, None)
        if state is None:
            return []
        self._engine.abort_request([request_id])
        for sample in state.samples:
            sample.finish_reason = sample.finish_reason or "abort"
        return [self._output(state)]

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._engine.collective_rpc(_load_weights_on_worker, args=(list(weights),))
        self._engine.reset_prefix_cache()

    def _on_version_change(self) -> None:
        for state in self._states.values():
            for sample in state.samples:
                if sample.finish_reason is not None:
                    continue
                position = len(sample.token_ids)
                if sample.version_changes[-1][0] == position:
                    sample.version_changes[-1] = (position, self._policy_version)
                else:
                    sample.version_changes.append((position, self._policy_version))

    @staticmethod
    def _output(state: _RequestState) -> RequestOutput:
        request = state.request
        completions = [
            Completion(
                request.request_id,
                index,
                sample.token_ids,
                sample.logprobs,
                _finish_reason(sample.finish_reason),
                tuple(sample.version_changes),
            )
            for index, sample in enumerate(state.samples)
        ]
        return RequestOutput(request.request_id, tuple(request.prompt_token_ids), completions)


def _finish_reason(vllm_reason: str | None) -> FinishReason:
    """vLLM's finish reason in ours: "stop" and "length" as they are, anything else "abort"."""
    if vllm_reason == "stop":
        return "stop"
    if vllm_reason == "length":
        return "length"
    return "abort"
