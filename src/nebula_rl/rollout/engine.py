"""The generation-engine interface every rollout backend implements, and its request/result types.

An engine generates `n` completions per prompt and returns, for every completion, its token ids,
the log-prob of each token under the distribution it was sampled from, its finish reason and the
policy version that produced each token. New weights can arrive at any time: they are applied at
the next token boundary (between two decode steps) and generation continues; nothing is dropped.

Two ways to drive an engine:

- synchronously, from one thread: `add_request(...)` then `step()` until `has_unfinished()` is
  false (or `generate([...])`, which does that). Tests and benchmarks use this.
- in the background: `start()` runs the step loop in a thread; `submit(request)` returns a
  `concurrent.futures.Future` of the `RequestOutput`; `update_weights`, `pause`, `resume` and
  `abort` are safe to call from other threads. The rollout worker uses this: its network thread
  receives weights while the engine keeps generating.

Concrete backends implement five hooks (`_add_request`, `_abort`, `_step`, `_load_weights`,
`_num_unfinished`); this base class owns the threading, so every backend has the same
boundary semantics. Backends are chosen by name through `ENGINES`, and each is imported only when
chosen, so vLLM is never imported unless `rollout.backend = "vllm"`.
"""

from __future__ import annotations

import bisect
import importlib
import itertools
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from nebula_rl.data.vision import VisionInputs

FinishReason = Literal["stop", "length", "abort"]
Continuation = Callable[[int, list[int]], "Future[list[int] | None]"]
"""Multi-turn: `(sample index, its tokens so far) -> future of the tokens to append`."""
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's completions.

    Log-probs are always of the distribution the token was actually drawn from: logits
    repetition-penalised, divided by `temperature`, then restricted to `top_k` / `top_p` and
    renormalised. This is the behaviour policy that off-policy corrections need. With
    `temperature == 0` (greedy) the token is the argmax and its log-prob is taken at temperature 1
    (with the same penalty and top-k/top-p restriction).
    """

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1 = off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on tokens already in the prompt or the completion: their positive logits
    are divided by it, negative ones multiplied; 1 = off."""
    max_tokens: int = 16
    """Maximum number of generated tokens per completion (also capped by the engine's max_model_len)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (the stop token is kept in the completion)."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion once the decoded text contains one; needs a tokenizer."""
    ignore_eos: bool = False
    """Do not stop at the model's eos token(s) (benchmarks use this for a fixed length)."""
    seed: int | None = None
    """Per-request seed: completion i of the request uses seed + i, independent of batching."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"sampling.repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        # Accept lists from callers (e.g. config) while keeping the dataclass hashable; a single
        # string is one stop string (as in vLLM), not a tuple of its characters.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(stop):
            raise ValueError("sampling.stop must not contain an empty string")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", stop)


_request_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One prompt to complete `n` times."""

    prompt_token_ids: Sequence[int]
    """The prompt, already tokenized (chat template applied)."""
    n: int = 1
    """Number of completions to sample from this prompt (the GRPO group size)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How to sample."""
    request_id: str = field(default_factory=lambda: f"req-{next(_request_counter)}")
    """Unique id; results and abort() refer to it."""
    media: VisionInputs | None = None
    """A vision-language prompt's images and videos, as `data.vision.VisionProcessor` made them
    with `prompt_token_ids` (whose media tokens are already expanded); None for text."""
    continuation: Continuation | None = None
    """Multi-turn (the torch engine): called when a sample stops (a stop token or string) with
    its index and tokens so far; the future's result is an observation, tokens appended without
    sampling before the sample decodes on, or None (or no tokens) to finish it. The sample keeps
    its KV cache while it waits; only the observation's tokens are run through the model."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"request.n must be >= 1, got {self.n}")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished sample.

    `version_changes` records the policy version of every token compactly, as change points
    `(token_index, policy_version)`: token i was sampled with the version of the last entry whose
    token_index <= i. A completion generated entirely under one version has one entry `(0, v)`;
    one that spans a weight update at its 7th token has `((0, v), (7, v + 1))`.
    """

    request_id: str
    """Id of the request this completion belongs to."""
    index: int
    """Sample index within the request, 0 .. n-1."""
    token_ids: list[int]
    """Generated tokens (prompt excluded; a stop token is included)."""
    logprobs: list[float]
    """log p(token) under the sampling distribution that drew it, one per token."""
    finish_reason: FinishReason
    """"stop" (stop token/string), "length" (max_tokens or max_model_len) or "abort"."""
    version_changes: tuple[tuple[int, int], ...]
    """(token_index, policy_version) change points, first entry at token_index 0."""
    observations: tuple[tuple[int, int], ...] = ()
    """Multi-turn: the `[start, end)` token ranges a continuation appended (not sampled; their
    log-probs are 0)."""

    @property
    def policy_version(self) -> int:
        """The oldest policy version that produced a token of this completion."""
        return min(v for _, v in self.version_changes)

    @property
    def policy_versions(self) -> list[int]:
        """The policy version of every token, expanded from `version_changes`."""
        out: list[int] = []
        bounds = [i for i, _ in self.version_changes[1:]] + [len(self.token_ids)]
        for (start, version), end in zip(self.version_changes, bounds, strict=True):
            out.extend([version] * (end - start))
        return out


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """All `n` completions of a request, returned once the last of them has finished."""

    request_id: str
    """Id of the request."""
    prompt_token_ids: tuple[int, ...]
    """The prompt."""
    completions: list[Completion]
    """The request's completions, ordered by index."""


def version_changes_for(
    version_log: Sequence[tuple[int, int]], first_step: int, num_tokens: int
) -> tuple[tuple[int, int], ...]:
    """Change points of a completion whose token i was sampled at engine step `first_step + i`.

    `version_log` lists `(step, policy_version)`, sorted by step: the version in force from that
    step on. Engines that produce one token per sequence per step use this to build the record
    at finish time, with no per-token bookkeeping.
    """
    steps = [s for s, _ in version_log]
    start = bisect.bisect_right(steps, first_step) - 1
    assert start >= 0, "version_log must start at or before the first step"
    changes = [(0, version_log[start][1])]
    for step, version in version_log[start + 1 :]:
        if step >= first_step + num_tokens:
            break
        changes.append((step - first_step, version))
    return tuple(changes)


class Engine(ABC):
    """A batch generation engine with token-granular weight updates.

    Thread safety: `add_request`, `submit`, `abort`, `update_weights`, `pause` and `resume` may be
    called from any thread. `step()` runs one token step under the engine's step lock; a weight
    update takes the same lock, so it lands exactly between two steps. The background loop
    (`start()`) yields to a waiting update before starting its next step.
    """

    def __init__(self, *, policy_version: int = 0) -> None:
        self._policy_version = policy_version
        self._step_lock = threading.Lock()
        # Guards the small flags below; the loop waits on it.
        self._signal = threading.Condition()
        self._paused = False
        self._damaged = False
        self._num_waiting_updates = 0
        self._intake: deque[GenerationRequest] = deque()
        # Ids of requests added and not yet returned (queued or running): ids must be unique
        # among them, since results and abort() refer to requests by id.
        self._pending_ids: set[str] = set()
        self._abort_intake: deque[str] = deque()
        self._futures: dict[str, Future[RequestOutput]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._loop_error: BaseException | None = None

    # ------------------------------------------------------------------ backend hooks
    @abstractmethod
    def _add_request(self, request: GenerationRequest) -> None:
        """Queue a validated request (called under the step lock)."""

    @abstractmethod
    def _abort(self, request_id: str) -> list[RequestOutput]:
        """Abort a request; return its output (finish_reason "abort") if it was known."""

    @abstractmethod
    def _step(self) -> list[RequestOutput]:
        """Advance every running sequence by one token; return requests that finished."""

    @abstractmethod
    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named tensors into the model (called between steps, under the step lock)."""

    @abstractmethod
    def _num_unfinished(self) -> int:
        """Number of requests admitted to the backend and not yet returned."""

    def validate(self, request: GenerationRequest) -> None:  # noqa: B027 (optional hook)
        """Raise ValueError if this engine cannot serve the request (override to add checks)."""

    # ------------------------------------------------------------------ public API
    @property
    def policy_version(self) -> int:
        """The policy version of the weights currently loaded."""
        return self._policy_version

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; it joins the running batch at the next step. Thread-safe.

        Raises ValueError if the engine cannot serve it, or if a request with the same id is
        still queued or running.
        """
        self.validate(request)
        with self._signal:
            if request.request_id in self._pending_ids:
                raise ValueError(f"duplicate request_id {request.request_id!r}: still running")
            self._pending_ids.add(request.request_id)
            self._intake.append(request)
            self._signal.notify_all()

    def submit(self, request: GenerationRequest) -> Future[RequestOutput]:
        """Queue a request and return a future of its output, resolved by the step that finishes it
        (the background loop of `start()`, or your own `step()` calls)."""
        if self._loop_error is not None:
            raise RuntimeError("the engine loop has failed") from self._loop_error
        future: Future[RequestOutput] = Future()
        with self._signal:
            if request.request_id in self._futures:
                raise ValueError(f"duplicate request_id {request.request_id!r}: still running")
            self._futures[request.request_id] = future
        try:
            self.add_request(request)
        except BaseException:
            with self._signal:
                del self._futures[request.request_id]
            raise
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step; its output comes back with finish_reason "abort"."""
        self._abort_intake.append(request_id)
        with self._signal:
            self._signal.notify_all()

    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""
        return bool(self._intake) or self._num_unfinished() > 0

    def step(self) -> list[RequestOutput]:
        """Run one token step for every running sequence; return the requests that finished.

        Does nothing while paused. New and aborted requests are taken in at the start of the
        step; futures from `submit()` of the finished requests are resolved.
        """
        with self._step_lock:
            if self._paused or self._damaged:
                return []
            outputs: list[RequestOutput] = []
            while self._intake:
                self._add_request(self._intake.popleft())
            while self._abort_intake:
                outputs.extend(self._abort(self._abort_intake.popleft()))
            if self._num_unfinished() > 0:
                outputs.extend(self._step())
        with self._signal:
            futures = [self._futures.pop(o.request_id, None) for o in outputs]
            self._pending_ids.difference_update(o.request_id for o in outputs)
        for output, future in zip(outputs, futures, strict=True):
            if future is not None:
                future.set_result(output)
        return outputs

    def generate(self, requests: Sequence[GenerationRequest]) -> list[RequestOutput]:
        """Run `requests` to completion synchronously; outputs in the order of `requests`."""
        if self._thread is not None:
            raise RuntimeError("generate() is synchronous; use submit() while the loop runs")
        ids = [r.request_id for r in requests]
        if len(set(ids)) < len(ids):
            raise ValueError("generate(): request ids must be unique")
        for request in requests:
            self.validate(request)
        for request in requests:
            self.add_request(request)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            # While paused (by another thread), wait for resume() instead of spinning on step().
            with self._signal:
                self._signal.wait_for(lambda: not self._paused)
            for output in self.step():
                done[output.request_id] = output
        return [done[r.request_id] for r in requests]

    def update_weights(self, weights: NamedTensors, *, policy_version: int) -> None:
        """Load new weights at the next token boundary; return once they are in place.

        `weights` maps parameter names (as in `model.state_dict()`) to tensors, as a mapping or an
        iterable of pairs; a subset is fine. All of them are applied at the same boundary, and
        every token sampled afterwards records `policy_version`. An iterable is consumed while
        generation is paused, so receive tensors first if the receive should overlap generation.
        Callable from any thread.
        """
        items = weights.items() if isinstance(weights, Mapping) else weights

        def load() -> int:
            self._load_weights(items)
            return policy_version

        self.update_weights_with(load)

    def update_weights_with(self, write: Callable[[], int | None]) -> None:
        """Run `write` at the next token boundary, generation paused: it writes new weights into
        the model's own tensors in place (e.g. `ShardedReceiver.receive`, which receives each
        slice straight into the parameters, with no staging copy) or re-points them at new
        storage (a zero-copy `ShardedReceiver`), and returns their policy version, which every
        token sampled afterwards records. Callable from any thread.

        `write` returns None when the update failed part-way (e.g. the sender died): the weights
        may then be a mix of two versions, so the engine generates nothing (`damaged`) until an
        update completes."""
        with self._signal:
            self._num_waiting_updates += 1
        try:
            with self._step_lock, torch.no_grad():
                try:
                    version = write()
                finally:
                    self._weights_written()
                self._damaged = version is None
                if version is not None:
                    self._policy_version = version
                    self._on_version_change()
        finally:
            with self._signal:
                self._num_waiting_updates -= 1
                self._signal.notify_all()

    def _weights_written(self) -> None:  # noqa: B027 (optional hook)
        """Hook: `update_weights_with`'s `write` ran (it may have re-pointed parameters at new
        storage instead of writing into them)."""

    @property
    def damaged(self) -> bool:
        """Whether the last weight update failed part-way (nothing is generated until one
        completes)."""
        return self._damaged

    _idle_s: float | None = None
    """Seconds the background loop waits for work before it calls `_on_idle` (None: forever)."""

    def _on_idle(self) -> None:  # noqa: B027 (optional hook)
        """Hook: the background loop had nothing to do for `_idle_s` seconds."""

    def _on_version_change(self) -> None:  # noqa: B027 (optional hook)
        """Hook for backends that keep a version log (called under the step lock)."""

    def pause(self) -> None:
        """Stop generating at the next token boundary; returns once the current step is done."""
        with self._signal:
            self._paused = True
        with self._step_lock:
            pass

    def resume(self) -> None:
        """Continue generating after `pause()`."""
        with self._signal:
            self._paused = False
            self._signal.notify_all()

    @property
    def paused(self) -> bool:
        """Whether the engine is paused."""
        return self._paused

    # ------------------------------------------------------------------ background loop
    def start(self) -> None:
        """Run the step loop in a background thread; results resolve `submit()` futures."""
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="nebula-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the background loop (running requests stay queued; pending futures stay open)."""
        if self._thread is None:
            return
        with self._signal:
            self._stopping = True
            self._signal.notify_all()
        self._thread.join()
        self._thread = None

    def _running(self) -> bool:
        return not (self._paused or self._damaged)

    def _ready(self) -> bool:
        return (
            self._stopping
            or (self._running() and self._num_waiting_updates == 0 and self.has_unfinished())
            or bool(self._abort_intake and self._running())
        )

    def _loop(self) -> None:
        """Step while there is work; yield to waiting weight updates and to pause()."""
        try:
            while True:
                with self._signal:
                    ready = self._signal.wait_for(self._ready, timeout=self._idle_s)
                    if self._stopping:
                        return
                if ready:
                    self.step()
                else:
                    self._on_idle()
        except BaseException as error:  # supervised: fail every waiter loudly, never hang them
            with self._signal:
                self._loop_error = error
                futures = list(self._futures.values())
                self._futures.clear()
            for future in futures:
                future.set_exception(error)
            raise


# Registry of backends: name -> "module:Class", imported on first use so that optional heavy
# dependencies (vLLM) are only imported when chosen.
ENGINES: dict[str, str] = {
    "torch": "nebula_rl.rollout.torch_engine:TorchEngine",
    "vllm": "nebula_rl.rollout.vllm_engine:VLLMEngine",
}


def engine_class(backend: str) -> type[Engine]:
    """The Engine class registered as `backend` ("torch" or "vllm"), imported lazily."""
    if backend not in ENGINES:
        raise ValueError(f"rollout.backend must be one of {sorted(ENGINES)}, got {backend!r}")
    module_name, class_name = ENGINES[backend].split(":")
    return getattr(importlib.import_module(module_name), class_name)
