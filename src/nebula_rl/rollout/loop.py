"""What every rollout replica does, whatever it generates: follow the weight group in a thread,
claim and generate until the controller ends the job, report its numbers in the heartbeat.

:class:`RolloutLoop` is that lifecycle; a modality's worker supplies the step (a language
model's engine requests, `rollout.worker.RolloutWorker`; a world model's sampler batches,
`flow.runtime.FlowRolloutWorker`) and how pushed weights reach its model."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.weights.elastic import ElasticReceiver

__all__ = ["RolloutLoop", "serve"]


class RolloutLoop(abc.ABC):
    """One rollout replica's loop (rank 0 of it)."""

    def __init__(self, session: ReplicaSession) -> None:
        self.session = session
        self.cfg = session.cfg
        self.num_groups = 0
        """Groups pushed so far."""
        self.start_time = time.monotonic()
        self._weight_errors: list[BaseException] = []
        """What the weight thread raised (the main loop fails with it)."""
        self._closing = False

    def publish(self) -> None:
        """Report this worker's weights version and numbers in the heartbeats (which run while
        the model loads): call once the worker is built."""
        self.session.policy_version = lambda: self.policy_version
        self.session.stats = self.stats

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """The version of the weights generating now."""

    @abc.abstractmethod
    def start_weight_thread(self) -> None:
        """Follow the weight group and apply every push (:meth:`follow`)."""

    @abc.abstractmethod
    def step(self) -> None:
        """One pass: claim prompts, generate what the weights allow, push finished groups."""

    def stats(self) -> dict[str, float]:
        """Heartbeat numbers."""
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        return {"groups": float(self.num_groups), "groups_per_s": self.num_groups / elapsed}

    def follow(self, receiver: ElasticReceiver) -> None:
        """Run `receiver` in a daemon thread until the replica closes or the job ends."""
        self._weight_errors = receiver.run_in_background(
            stopped=lambda: self._closing or self.session.finished() is not None
        )

    def run(self) -> None:
        """Step until the controller ends the job; a failed weight thread fails the loop."""
        while self.session.finished() is None:
            if self._weight_errors:
                raise RuntimeError("the weight thread failed") from self._weight_errors[0]
            self.step()

    def close(self) -> None:
        """Stop following the weight group (subclasses release their own parts too)."""
        self._closing = True


def serve(worker: RolloutLoop, *, loaded: Callable[[], None] | None = None) -> None:
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
