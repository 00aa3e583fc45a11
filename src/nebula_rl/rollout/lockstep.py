"""A tensor-parallel engine whose ranks run in lock step: rank 0 is driven like any engine,
the other ranks replay what it does.

Every rank of a TP replica must run the same forward calls in the same order (each step
all-reduces across them), take the same requests, and apply weight updates at the same token
boundary. Rank 0 is the one the rollout worker talks to (`submit`, `abort`, `update_weights_with`,
the background loop); before each token step it broadcasts to the other ranks the requests and
aborts it took in since the last one, and before a weight update an "update" mark, so that the
others call their own receive (e.g. `ShardedReceiver.receive`) at the same boundary. The other
ranks sit in `follow()`, which replays those records until rank 0 calls `stop_followers()`.
Sampling needs no broadcast: the logits are identical on every rank (whole LM head after the
all-reduced residual stream) and the generators start from the same seed and draw the same
numbers, so every rank samples the same tokens; only rank 0's outputs are reported.

Multi-turn requests (`GenerationRequest.continuation`): only rank 0 runs the continuations. The
other ranks get each request with a stand-in continuation that never answers, so their samples
park where rank 0's do; before a step, rank 0 sends the observations that came back since the
last one (which slots, which tokens), and every rank appends them in that step.

Cost: one small object broadcast per token step (requests are pickled once, when they join).
While rank 0 has nothing to generate it sends an "idle" record every `IDLE_S` seconds, so the
other ranks, blocked in their broadcast, never reach the group's timeout in a long wait for
prompts or weights.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from nebula_rl.rollout.engine import GenerationRequest, RequestOutput
from nebula_rl.rollout.tensor_parallel import TensorParallel
from nebula_rl.rollout.torch_engine import TorchEngine

__all__ = ["LockstepEngine"]

_Op = tuple[str, Any]

IDLE_S = 10.0
"""Seconds between rank 0's keep-alive records while it has nothing to generate."""


class LockstepEngine(TorchEngine):
    """`TorchEngine` with tensor parallelism, kept in lock step across its ranks (see above).

    Build it on every rank with the same arguments (and seed). On rank 0 use it as any engine;
    on the others call `follow(receive)`.
    """

    _idle_s = IDLE_S

    def __init__(self, model: Any, *, tensor_parallel: TensorParallel, **kwargs: Any) -> None:
        super().__init__(model, tensor_parallel=tensor_parallel, **kwargs)
        self.tp = tensor_parallel
        self._records: list[_Op] = []
        self._answers: list[tuple[int, list[int] | None]] = []
        """The observations the next step appends (rank 0's, taken before it records them)."""

    @property
    def leader(self) -> bool:
        """Whether this is rank 0 of the replica (the rank the worker drives)."""
        return self.tp.rank == 0

    def _broadcast(self, message: object | None) -> Any:
        box = [message]
        dist.broadcast_object_list(box, group_src=0, group=self.tp.group)
        return box[0]

    # ------------------------------------------------------------------ rank 0: record and send
    def _add_request(self, request: GenerationRequest) -> None:
        if self.leader:
            followed = request
            if request.continuation is not None:  # (it runs here only)
                followed = dataclasses.replace(request, continuation=_never_answers)
            self._records.append(("add", followed))
        super()._add_request(request)

    def _abort(self, request_id: str) -> list[RequestOutput]:
        if self.leader:
            self._records.append(("abort", request_id))
        return super()._abort(request_id)

    def _flush(self, kind: str, note: Any = None) -> None:
        records, self._records = self._records, []
        self._broadcast((kind, records, note))

    def _on_idle(self) -> None:
        with self._step_lock:
            self._flush("idle")

    def _step(self) -> list[RequestOutput]:
        if self.leader:
            self._answers = super()._answered()
            if self._answers:
                self._records.append(("answers", self._answers))
            self._flush("step")
        return super()._step()

    def _answered(self) -> list[tuple[int, list[int] | None]]:
        """The observations rank 0 took before this step (every rank appends the same)."""
        answers, self._answers = self._answers, []
        for slot, _ in answers:
            self._parked.pop(slot, None)  # (a stand-in on the other ranks)
        return answers

    def update_weights_with(self, write: Callable[[], int | None], *, note: Any = None) -> None:
        """Rank 0: tell the other ranks to run their receive at this same boundary (handing it
        `note`, e.g. which push to take), then run `write` (a collective with theirs, such as
        `ShardedReceiver.receive`)."""
        if not self.leader:
            raise RuntimeError("only rank 0 of a tensor-parallel replica takes weight updates")

        def marked() -> int | None:
            self._flush("update", note)
            return write()

        super().update_weights_with(marked)

    def stop_followers(self) -> None:
        """Rank 0: release the other ranks from `follow()` (call once, at the end)."""
        with self._step_lock:
            self._flush("stop")

    # ------------------------------------------------------------------ ranks > 0: replay
    def follow(self, receive: Callable[[Any], int | None]) -> list[RequestOutput]:
        """Ranks > 0: replay rank 0's requests, steps and weight updates (calling `receive(note)`
        for each update, with rank 0's `note`) until it calls `stop_followers`; the outputs this
        rank produced (the same as rank 0's), mostly for tests."""
        if self.leader:
            raise RuntimeError("rank 0 drives the engine; only the other ranks follow")
        outputs: list[RequestOutput] = []
        while True:
            kind, records, note = self._broadcast(None)
            for op, arg in records:
                if op == "add":
                    super()._add_request(arg)
                elif op == "answers":
                    self._answers = arg
                else:
                    outputs.extend(super()._abort(arg))
            if kind == "stop":
                return outputs
            if kind == "update":
                super().update_weights_with(functools.partial(receive, note))
            elif kind == "step":
                outputs.extend(super()._step())


def _never_answers(index: int, tokens: list[int]) -> Future[list[int] | None]:
    """The continuation of a multi-turn request on the ranks that follow rank 0: its answer
    comes from rank 0's step records."""
    return Future()
