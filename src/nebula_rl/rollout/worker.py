"""The rollout replica, whatever it generates: claim prompts from the job's streams (validation
prompts first), hand each to the modality's :class:`Generator` once its weights reach the
prompt's `min_version`, count what it pushes, follow the weight group in a thread and report in
the heartbeat, until the controller ends the job.

A language model's generator is `rollout.text.TextGenerator` (the engine's requests, scored in
a pool while generation goes on); a world model's is `flow.runtime.WorldGenerator` (the SDE
sampler's batches). A generator pushes each group before it acknowledges the prompt, so a crash
in between can only duplicate a group (the controller keeps the first), never lose a prompt."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.models import resolve_dtype
from nebula_rl.protocol import Prompt
from nebula_rl.weights.elastic import ElasticReceiver
from nebula_rl.weights.group import WeightGroup, weight_backend
from nebula_rl.weights.reshard import Box, ShardedReceiver

__all__ = ["Claimed", "Generator", "RolloutWorker", "serve", "weight_receiver"]


@dataclass(frozen=True, slots=True)
class Claimed:
    """A prompt this replica holds: its stream id and the prompt (a generator may add what it
    prepares at claim time)."""

    msg_id: str
    prompt: Prompt


class Generator(Protocol):
    """What a rollout replica's modality supplies: its model, how a claimed prompt becomes
    generated, scored and pushed groups, and how the policy's pushes reach the model."""

    claim_limit: int
    """Prompts the replica holds at most (generating, or waiting for room or weights)."""

    @property
    def policy_version(self) -> int:
        """The version of the weights generating now."""
        ...

    def prepare(self, msg_id: str, prompt: Prompt) -> Claimed:
        """A claimed prompt as this generator will take it (e.g. its row read, its tokens
        prepared in a loader thread)."""
        ...

    def submit(self, claimed: Sequence[Claimed]) -> int:
        """Take prompts the weights reach (all validation prompts, or all training prompts);
        returns the groups pushed already (a prompt that cannot be generated)."""
        ...

    def in_flight(self) -> int:
        """Prompts taken and not yet generated (they count against `claim_limit`)."""
        ...

    def busy(self) -> bool:
        """Whether any prompt taken is not pushed yet."""
        ...

    def collect(self, timeout_s: float) -> int:
        """Push the groups that are done (waiting up to `timeout_s` for one); how many."""
        ...

    def receiver(self, session: ReplicaSession) -> ElasticReceiver:
        """This replica's member of the weight group, applying every push to the model."""
        ...

    def start(self) -> None:
        """Start what generates in the background (an engine's step loop, a file server)."""
        ...

    def stats(self) -> dict[str, float]:
        """Numbers of its own for the heartbeat (e.g. tokens per second)."""
        ...

    def close(self, *, job_ended: bool) -> None:
        """Release the model's parts (threads, processes, files nobody will read)."""
        ...


class RolloutWorker:
    """One rollout replica's loop (rank 0 of it) around its modality's generator."""

    def __init__(self, session: ReplicaSession, generator: Generator) -> None:
        self.session = session
        self.cfg = session.cfg
        self.generator = generator
        self.waiting: deque[Claimed] = deque()
        self.val_waiting: deque[Claimed] = deque()
        self.num_groups = 0
        """Groups pushed so far."""
        self.start_time = time.monotonic()
        self._weight_errors: list[BaseException] = []
        """What the weight thread raised (the main loop fails with it)."""
        self._closing = False
        # The heartbeats (which run while the model loads) report the weights and numbers.
        session.policy_version = lambda: generator.policy_version
        session.stats = self.stats

    @property
    def policy_version(self) -> int:
        return self.generator.policy_version

    def stats(self) -> dict[str, float]:
        """Heartbeat numbers."""
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        numbers = {"groups": float(self.num_groups), "groups_per_s": self.num_groups / elapsed}
        return numbers | self.generator.stats()

    def start_weight_thread(self) -> None:
        """Follow the weight group in a daemon thread until the replica closes or the job ends
        (:class:`~nebula_rl.weights.elastic.ElasticReceiver`: a push that fails makes the group
        be rebuilt, not the replica fail)."""
        receiver = self.generator.receiver(self.session)
        self._weight_errors = receiver.run_in_background(
            stopped=lambda: self._closing or self.session.finished() is not None
        )

    def run(self) -> None:
        """Step until the controller ends the job; a failed weight thread fails the loop."""
        self.generator.start()
        while self.session.finished() is None:
            if self._weight_errors:
                raise RuntimeError("the weight thread failed") from self._weight_errors[0]
            self.step()

    def step(self) -> None:
        """One pass: claim prompts, hand the generator those its weights allow, push what is
        done (waiting briefly for it)."""
        idle = not (self.waiting or self.val_waiting or self.generator.busy())
        self.claim(block_ms=200 if idle else 0)
        self.num_groups += self.submit_ready()
        if self.generator.busy():
            self.num_groups += self.generator.collect(0.05)
        else:
            time.sleep(0.01)

    def claim(self, *, block_ms: int = 0) -> int:
        """Claim prompts up to the generator's `claim_limit` held, validation prompts first (at
        most `validation.batch_size`, else `rollout.batch_size`, at once), then training prompts
        (at most `rollout.batch_size` at once, less the validation prompts claimed); returns how
        many."""
        limit = self.generator.claim_limit
        held = len(self.waiting) + len(self.val_waiting) + self.generator.in_flight()
        r, v = self.cfg.rollout, self.cfg.validation
        room = min(limit - held, r.batch_size)
        state, name = self.session.state, self.session.name
        claimed = 0
        if v.enable and held < limit:
            val_room = min(limit - held, v.batch_size or r.batch_size)
            for msg_id, prompt in state.claim_validation(name, val_room):
                self.val_waiting.append(self.generator.prepare(msg_id, prompt))
                claimed += 1
        room -= claimed
        if room > 0:
            for msg_id, prompt in state.claim_prompts(
                name, room, block_ms=0 if claimed else block_ms
            ):
                self.waiting.append(self.generator.prepare(msg_id, prompt))
                claimed += 1
        return claimed

    def submit_ready(self) -> int:
        """Hand the generator every held prompt whose `min_version` its weights reach, the
        validation prompts first; returns the groups pushed already."""
        version = self.generator.policy_version
        pushed = 0
        for queue in (self.val_waiting, self.waiting):
            ready: list[Claimed] = []
            while queue and queue[0].prompt.min_version <= version:
                ready.append(queue.popleft())
            if ready:
                pushed += self.generator.submit(ready)
        return pushed

    def close(self) -> None:
        """Stop following the weight group and release the generator."""
        self._closing = True
        self.generator.close(job_ended=self.session.finished() is not None)


def weight_receiver(
    session: ReplicaSession,
    params: Mapping[str, torch.Tensor],
    boxes: Mapping[str, tuple[tuple[int, ...], Box]],
    *,
    device: torch.device,
    apply: Callable[[Callable[[], int | None]], None] | None,
    zero_copy: bool = False,
    local_rank: int = 0,
) -> ElasticReceiver:
    """A rollout rank's member of the weight group: each push lands in `params` (by name;
    `boxes`: each tensor's whole shape and the box of it this rank takes), `apply` takes it in
    (given the receive to run); without `apply` the member only joins and leaves generations
    (ranks > 0 of a tensor-parallel replica, which take pushes with `receive_for`).
    `zero_copy`: CPU tensors may become views of the policy's shared-memory set."""
    cfg = session.cfg
    transfer = cfg.train.transfer_dtype
    transfer_dtype = resolve_dtype(transfer) if transfer else None

    def make_receiver(group: WeightGroup, num_senders: int) -> ShardedReceiver:
        return ShardedReceiver(
            group,
            params,
            boxes,
            num_senders=num_senders,
            transfer_dtype=transfer_dtype,
            zero_copy=zero_copy,
        )

    return ElasticReceiver(
        session.state,
        session.name,
        make_receiver=make_receiver,
        apply=apply or (lambda receive: None),
        local_rank=local_rank,
        membership_only=apply is None,
        backend=weight_backend(cfg.mode, device),
        timeout=timedelta(seconds=cfg.controller.collective_timeout),
    )


def serve(worker: RolloutWorker, *, loaded: Callable[[], None] | None = None) -> None:
    """A rollout replica's life around `worker`: weights followed, heartbeats, ready for the
    weight group (after `loaded`: e.g. the other ranks report their shards), the loop, close."""
    worker.start_weight_thread()
    if loaded is not None:
        loaded()
    worker.session.start_heartbeats()
    worker.session.mark_ready()  # the controller adds it to the weight group now
    try:
        worker.run()
    finally:
        worker.close()
