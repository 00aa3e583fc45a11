"""vLLM behind nebula-rl's `Engine` interface (`rollout.backend = "vllm"`).

- vLLM's `LLMEngine` runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and the base
  class steps it: one `step()` is one scheduler step, one token for every running sample. A
  weight update takes the step lock, so it lands between two tokens, as in the built-in engine
  (docs/weight-sync.md says why `LLMEngine` stepping and not `AsyncLLM`).
- Each sample is a vLLM request of its own (`<request id>#<index>`, n = 1), so sample i of a
  request with a seed uses seed + i (as the built-in engine), finishes on its own, and carries
  its own policy versions. The samples of a prompt share its KV blocks through vLLM's prefix
  cache, salted with the policy version (`cache_salt`): a prompt that arrives after an update
  never reuses blocks computed with older weights, while the samples running through an update
  keep theirs (the built-in engine's semantics) and no reset has to wait for them.
- Log-probs: `logprobs_mode = "processed_logprobs"`, after penalties, temperature, top-k and
  top-p: the built-in engine's definition.
- Weights: the rollout replica receives each push into :attr:`staging`, a Hugging Face copy of
  the model (the policy's slices go there as for the built-in engine), and the engine loads the
  tensors that arrived into every vLLM worker through vLLM's own `load_weights`
  (`nebula_rl.rollout.vllm_worker`), which fuses q/k/v and gate/up and cuts each
  tensor-parallel worker's slices. Workers in processes of their own (tensor parallel) get a
  shared-memory file and read their slices of it (`nebula_rl.rollout.shared_weights`), not the
  whole model each. On CPU `vllm_worker` keeps vLLM's linear weights unpacked so they can be
  written (see there).
- Multi-turn (`GenerationRequest.continuation`): a sample that stops hands its tokens to the
  continuation and waits; the observation that comes back is appended (log-prob 0, recorded in
  `Completion.observations`) and the sample goes on as a new vLLM request over its whole
  context, whose cached blocks (the same salt, unless the weights changed meanwhile) vLLM's
  prefix cache reuses, so only the observation is prefilled.
- On CPU, vLLM's KV cache is `VLLM_CPU_KVCACHE_SPACE` GiB (1 unless set) and its OpenMP threads
  are not pinned to cores (`VLLM_CPU_OMP_THREADS_BIND=nobind`), so that co-located processes
  share the machine as the built-in engine's do.

vLLM is imported here only, and only when the backend is chosen.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
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
from nebula_rl.rollout.shared_weights import SharedWeights
from nebula_rl.weights.reshard import Box, full_box

__all__ = ["VLLMEngine", "vllm_environment"]

WORKER_EXTENSION = "nebula_rl.rollout.vllm_worker.WeightLoader"


def vllm_environment(device: torch.device | str) -> None:
    """Settings vLLM reads from the environment, set (unless the user set them) before it is
    imported: the engine in this process, and on CPU a 1 GiB KV cache and unpinned threads."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if torch.device(device).type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@dataclass
class _Sample:
    version_changes: list[tuple[int, int]]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    observations: list[tuple[int, int]] = field(default_factory=list)
    """Multi-turn: the [start, end) token ranges a continuation appended."""
    parked: Future[list[int] | None] | None = None
    """Multi-turn: the continuation's answer it waits for."""
    turns: int = 0


@dataclass
class _RequestState:
    request: GenerationRequest
    samples: list[_Sample]
    running: set[str]
    """The vLLM request ids of its samples still generating."""

    def done(self) -> bool:
        return not self.running and all(s.parked is None for s in self.samples)


class VLLMEngine(Engine):
    """Generation with vLLM, with the built-in engine's interface and semantics.

    Args:
        model: a Hugging Face checkpoint folder or Hub id (vLLM loads it itself).
        staging: the Hugging Face model whose parameters receive weight pushes (its weights are
            not read at build time); None for an engine that is only ever given tensors.
        policy_version: the version of the weights in `model`.
        dtype: the weights' dtype in vLLM.
        device: where vLLM runs ("cpu" or "cuda"), for the environment it reads.
        max_model_len: longest prompt + completion (None: the model's).
        seed: the seed of samples whose request has none.
        engine_kwargs: more `vllm.EngineArgs` (tensor_parallel_size, max_num_seqs, ...).
    """

    def __init__(
        self,
        model: str,
        *,
        staging: torch.nn.Module | None = None,
        policy_version: int = 0,
        dtype: str = "bfloat16",
        device: torch.device | str = "cuda",
        max_model_len: int | None = None,
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__(policy_version=policy_version)
        vllm_environment(device)
        from vllm import EngineArgs, LLMEngine

        from nebula_rl.rollout.vllm_worker import keep_cpu_linear_weights

        keep_cpu_linear_weights()
        # (prefill whole prompts unless asked: after a partial prefill vLLM rewinds seeded
        # requests' generators, which torch's CPU generators cannot do)
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        args = EngineArgs(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            **engine_kwargs,
        )
        self._engine = LLMEngine.from_engine_args(args)
        self.max_model_len = int(self._engine.model_config.max_model_len)
        self.staging = staging
        self._states: dict[str, _RequestState] = {}
        self._owner: dict[str, tuple[str, int]] = {}
        """vLLM request id -> (our request id, sample index)."""
        self._loaded_directly = False
        """The update being applied gave its tensors to `_load_weights` (not the staging)."""
        parallel = self._engine.vllm_config.parallel_config
        self._separate_workers = parallel.world_size > 1
        """vLLM's workers run in processes of their own (tensor or pipeline parallel)."""
        self._staging_file: SharedWeights | None = None

    # -- what a rollout replica needs of an engine ----------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The staging model: what weight pushes write into."""
        if self.staging is None:
            raise RuntimeError("this vLLM engine has no staging model to receive weights into")
        return self.staging

    def tp_boxes(self) -> dict[str, tuple[tuple[int, ...], Box]]:
        """Per staging tensor: its shape and the box of it this replica receives (all of it:
        vLLM cuts each worker's slices from the whole tensor)."""
        return {
            name: (tuple(p.shape), full_box(p.shape)) for name, p in self.model.named_parameters()
        }

    # -- backend hooks --------------------------------------------------------------------------

    def _sampling_params(self, request: GenerationRequest, index: int, sample: _Sample) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        room = min(s.max_tokens, self.max_model_len - len(request.prompt_token_ids))
        seed = None if s.seed is None else s.seed + index + 7919 * sample.turns
        return SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            repetition_penalty=s.repetition_penalty,
            max_tokens=room - len(sample.token_ids),
            stop_token_ids=list(s.stop_token_ids),
            stop=list(s.stop),
            include_stop_str_in_output=True,
            ignore_eos=s.ignore_eos,
            seed=seed,
            logprobs=0,
            detokenize=bool(s.stop),  # (token ids are the product; text only for stop strings)
            output_kind=RequestOutputKind.DELTA,
        )

    def validate(self, request: GenerationRequest) -> None:
        if request.media is not None:
            raise ValueError(
                f"request {request.request_id!r}: images and videos are not passed to vLLM"
            )
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: its prompt of {len(request.prompt_token_ids)} "
                f"tokens leaves no room within max_model_len {self.max_model_len}"
            )

    def _add_request(self, request: GenerationRequest) -> None:
        state = _RequestState(
            request,
            [_Sample([(0, self._policy_version)]) for _ in range(request.n)],
            set(),
        )
        self._states[request.request_id] = state
        for index in range(request.n):
            self._submit(state, index)

    def _submit(self, state: _RequestState, index: int) -> None:
        """Sample `index` of `state` goes (on) as a vLLM request over its prompt and tokens."""
        from vllm.inputs import TokensPrompt

        request, sample = state.request, state.samples[index]
        prompt = TokensPrompt(
            prompt_token_ids=[*request.prompt_token_ids, *sample.token_ids],
            cache_salt=f"policy-version-{self._policy_version}",
        )
        sub = f"{request.request_id}#{index}" + (f".{sample.turns}" if sample.turns else "")
        self._owner[sub] = (request.request_id, index)
        state.running.add(sub)
        self._engine.add_request(sub, prompt, self._sampling_params(request, index, sample))

    def _num_unfinished(self) -> int:
        return len(self._states)

    def _step(self) -> list[RequestOutput]:
        finished = self._resume_answered()
        for out in self._engine.step():
            owner = self._owner.get(out.request_id)
            if owner is None:  # (a request aborted meanwhile)
                continue
            state = self._states[owner[0]]
            sample = state.samples[owner[1]]
            for delta in out.outputs:
                sample.token_ids.extend(delta.token_ids)
                for token, logprobs in zip(delta.token_ids, delta.logprobs or [], strict=True):
                    sample.logprobs.append(float(logprobs[token].logprob))
                if delta.finish_reason is not None:
                    sample.finish_reason = _finish_reason(delta.finish_reason)
            if out.finished:
                del self._owner[out.request_id]
                state.running.discard(out.request_id)
                sample.finish_reason = sample.finish_reason or "abort"
                continuation = state.request.continuation
                if sample.finish_reason == "stop" and continuation is not None:
                    sample.finish_reason = None
                    sample.parked = continuation(owner[1], list(sample.token_ids))
                if state.done():
                    finished.append(self._output(self._states.pop(owner[0])))
        return finished

    def _resume_answered(self) -> list[RequestOutput]:
        """Multi-turn: the samples whose continuation answered append the observation and go
        on, or finish: "stop" on no observation, "length" when it and one more token do not
        fit. Waits a moment for an answer when nothing else runs."""
        parked = [
            (state, i, sample, sample.parked)
            for state in self._states.values()
            for i, sample in enumerate(state.samples)
            if sample.parked is not None
        ]
        if not parked:
            return []
        answers = [answer for *_, answer in parked]
        if not self._owner and not any(answer.done() for answer in answers):
            wait(answers, timeout=0.005, return_when=FIRST_COMPLETED)
        finished = []
        for state, index, sample, answer in parked:
            if not answer.done():
                continue
            observation = answer.result()
            sample.parked = None
            request = state.request
            room = min(
                request.sampling.max_tokens, self.max_model_len - len(request.prompt_token_ids)
            )
            num = len(sample.token_ids)
            if not observation or num + len(observation) >= room:
                sample.finish_reason = "length" if observation else "stop"
            else:
                sample.observations.append((num, num + len(observation)))
                sample.token_ids.extend(observation)
                sample.logprobs.extend([0.0] * len(observation))
                sample.turns += 1
                self._submit(state, index)
            if state.done() and state.request.request_id in self._states:
                finished.append(self._output(self._states.pop(state.request.request_id)))
        return finished

    def _abort(self, request_id: str) -> list[RequestOutput]:
        state = self._states.pop(request_id, None)
        if state is None:
            return []
        if state.running:
            self._engine.abort_request(sorted(state.running))
        for sub in state.running:
            del self._owner[sub]
        for sample in state.samples:
            sample.parked = None
            sample.finish_reason = sample.finish_reason or "abort"
        return [self._output(state)]

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._to_workers(list(weights), keep=False)
        self._loaded_directly = True

    def _to_workers(self, tensors: list[tuple[str, torch.Tensor]], *, keep: bool) -> None:
        """Load `tensors` into every vLLM worker: as tensors to a worker in this process; to
        workers in processes of their own through a shared-memory file
        (:mod:`nebula_rl.rollout.shared_weights`), so that each reads its own slices instead of
        receiving the whole model. With `keep` the file is the staging model's, laid out once
        and mapped by each worker once."""
        if not (self._separate_workers and all(t.device.type == "cpu" for _, t in tensors)):
            self._engine.collective_rpc("load_named_weights", args=(tensors,))
            return
        shapes = ((name, tuple(t.shape), t.dtype) for name, t in tensors)
        if not keep:
            file = SharedWeights(shapes)
        elif self._staging_file is None:
            file = self._staging_file = SharedWeights(shapes)
        else:
            file = self._staging_file
        try:
            file.write(tensors)
            self._engine.collective_rpc(
                "load_shared_weights", args=(file.path, file.manifest, keep)
            )
        finally:
            if keep:
                file.unlink()  # (every worker has mapped it now)
            else:
                file.close()

    def _weights_written(self) -> None:
        """A push wrote into the staging model (or re-pointed its tensors at the pushed set):
        load all of it into vLLM. (A trainable-only push leaves the rest as it was, so this
        reloads frozen tensors too: a copy of the model per push, which the push itself costs
        anyway.)"""
        if self._loaded_directly or self.staging is None:
            self._loaded_directly = False
            return
        params = [(name, p.detach()) for name, p in self.staging.named_parameters()]
        self._to_workers(params, keep=True)
        self._loaded_directly = False

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
        self._engine.reset_prefix_cache()  # (frees what it can; the salt keeps the rest apart)

    @staticmethod
    def _output(state: _RequestState) -> RequestOutput:
        request = state.request
        completions = [
            Completion(
                request.request_id,
                index,
                sample.token_ids,
                sample.logprobs,
                sample.finish_reason or "abort",
                tuple(sample.version_changes),
                tuple(sample.observations),
            )
            for index, sample in enumerate(state.samples)
        ]
        return RequestOutput(request.request_id, tuple(request.prompt_token_ids), completions)


def _finish_reason(vllm_reason: str) -> FinishReason:
    """vLLM's finish reason in ours: "stop" and "length" as they are, anything else "abort"."""
    if vllm_reason == "stop":
        return "stop"
    return "length" if vllm_reason == "length" else "abort"
