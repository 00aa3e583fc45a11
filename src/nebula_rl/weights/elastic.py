"""The weight group across membership changes: sender and receivers follow its generations.

The controller publishes the weight group's current :class:`~nebula_rl.weights.group.Generation`
(policy rank 0, the sender, first; then the rollout replicas) in the job's state, and publishes a
new one whenever a rollout replica joins or leaves, policy rank 0 changes, or a member reports the
group broken. Both sides poll it:

- :class:`ElasticSender` (policy rank 0): `refresh()`, called between training steps, leaves a
  superseded group and, when this replica is the sender of the new generation, builds the group
  and pushes the current weights, so a replica that joins gets them at once. `push()` announces
  each push in the job's state before broadcasting it.
- :class:`ElasticReceiver` (a rollout replica): the body of a background thread that joins every
  generation naming it, takes part in exactly the pushes announced for it, and hands each one to
  a callback (e.g. `engine.update_weights`).

A lost peer never ends a replica: when a push or receive fails (a member died: gloo notices at
once; or it hangs: the collective times out), the member leaves the group, which makes its peers'
pending collectives fail at once too, and asks for a regroup; the controller then publishes a new
generation among the live members and the sender pushes the current weights again. Only such
failures count (:func:`is_collective_failure`: torch.distributed's `DistError` family, gloo and
NCCL errors, timeouts, a superseded generation, a corrupted transfer); anything else (an
out-of-memory error, a bug in `make_sender` or `apply`) propagates and fails the replica with its
traceback, since rebuilding the group would only hide it.

Simplification: a sender or receiver that leaves a group while a collective is stuck in it (a peer
that hangs without dying) does not wait for it; the stuck thread ends at the group's timeout.
"""

from __future__ import annotations

import gc
import logging
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import redis
from torch import Tensor
from torch.distributed import DistError

from nebula_rl.weights.group import (
    CommBackend,
    Generation,
    GroupCancelled,
    WeightGroup,
    build_group,
    leave_group,
)
from nebula_rl.weights.transport import (
    CorruptedPushError,
    NamedTensors,
    PushHandle,
    WeightReceiver,
    WeightSender,
)

__all__ = [
    "KIND",
    "ElasticReceiver",
    "ElasticSender",
    "MembershipSource",
    "current_generation",
    "is_collective_failure",
]

log = logging.getLogger(__name__)

KIND = "weights"
"""The kind of the weight group in the job's state (the policy replicas' group is "policy")."""


class MembershipSource(Protocol):
    """Where generations are published (:class:`~nebula_rl.controller.state.JobState`); its
    Redis server is also where the members of a generation meet."""

    redis: redis.Redis

    def group_record(self, kind: str) -> dict[str, Any] | None: ...

    def request_regroup(self, kind: str, generation: int) -> None: ...

    def announce_push(self, generation: int) -> int: ...

    def num_pushes(self, generation: int) -> int: ...


_BACKEND_MESSAGE = re.compile(r"gloo|nccl", re.IGNORECASE)
"""gloo raises plain RuntimeErrors whose message names its source file (`.../gloo/transport/
tcp/pair.cc:...: Connection closed by peer`, `Timed out waiting ...`); NCCL's name NCCL."""


def is_collective_failure(err: BaseException) -> bool:
    """Whether `err` says that a weight group broke (a peer died or hung, the transfer was
    corrupted, the generation was replaced), which a regroup repairs; not a bug or an
    out-of-memory error of this replica, which must fail it."""
    if isinstance(err, TimeoutError | GroupCancelled | DistError | CorruptedPushError):
        return True
    return type(err) is RuntimeError and _BACKEND_MESSAGE.search(str(err)) is not None


_CAUGHT = (RuntimeError, TimeoutError, ValueError)
"""What the members catch and then judge with :func:`is_collective_failure` (re-raising the
rest)."""


def current_generation(source: MembershipSource, kind: str = KIND) -> Generation | None:
    """The published generation of group `kind`, None before the first."""
    record = source.group_record(kind)
    return None if record is None else Generation.from_record(record)


def _number(generation: Generation | None) -> int | None:
    return None if generation is None else generation.number


class _Member:
    """What the sender and the receivers share: following generations, joining, leaving."""

    def __init__(
        self, source: MembershipSource, name: str, *, backend: CommBackend, timeout: timedelta
    ) -> None:
        self.source, self.name, self.backend, self.timeout = source, name, backend, timeout
        self.generation: Generation | None = None
        """The generation followed: built, failed, or one this replica is not a member of."""
        self.group: WeightGroup | None = None

    def _superseded(self, generation: Generation) -> bool:
        return _number(current_generation(self.source)) != generation.number

    def _build(self, generation: Generation, rank: int) -> WeightGroup:
        return build_group(
            generation.rendezvous(self.source.redis),
            rank=rank,
            backend=self.backend,
            timeout=self.timeout,
            cancelled=lambda: self._superseded(generation),
        )

    def _leave(self) -> None:
        """Drop the group and everything that holds it, so its connections close now."""
        group, self.group = self.group, None
        busy = self._busy()
        self._drop()
        if not busy:  # (a collective stuck in another thread keeps the group until it times out)
            leave_group(group)
        del group
        gc.collect()

    def _busy(self) -> bool:
        """Whether a collective runs on the group in another thread (subclasses)."""
        return False

    def _drop(self) -> None:
        """Forget the objects built on the group (subclasses)."""

    def _fail(self, err: BaseException) -> None:
        """The group of `self.generation` broke: leave it and ask for a new one."""
        generation = self.generation
        assert generation is not None
        if isinstance(err, GroupCancelled) or self._superseded(generation):
            # (a peer that moved on to the newer generation left this one: nothing is broken)
            log.info("weight group generation %d was replaced: leaving it", generation.number)
        else:
            log.warning(
                "weight group generation %d failed on %s: %s", generation.number, self.name, err
            )
            self.source.request_regroup(KIND, generation.number)
        self._leave()


class ElasticSender(_Member):
    """Policy rank 0's side: the sender of whichever generation names this replica first.

    `make_sender` builds the :class:`WeightSender` on a new group (e.g. with the model's named
    parameters and the transfer dtype); building it is a collective with the receivers.
    """

    def __init__(
        self,
        source: MembershipSource,
        name: str,
        *,
        make_sender: Callable[[WeightGroup], WeightSender],
        backend: CommBackend = "gloo",
        timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        super().__init__(source, name, backend=backend, timeout=timeout)
        self.make_sender = make_sender
        self.sender: WeightSender | None = None
        self._pending: PushHandle | None = None
        self.last_version: int | None = None
        """Version of the last push started on the current group (None: none yet)."""

    def _busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def _drop(self) -> None:
        self.sender, self._pending, self.last_version = None, None, None

    def refresh(self, named_tensors: Callable[[], NamedTensors], version: int) -> None:
        """Follow the published generation: on a new one, leave the old group and, if this
        replica is its sender, build the group and push `named_tensors()` as `version`."""
        self._check_pending()
        generation = current_generation(self.source)
        if _number(generation) == _number(self.generation):
            return
        self._leave()
        self.generation = generation
        if generation is None or generation.rank_of(self.name) != 0:
            return
        if generation.world_size < 2:
            return  # no rollout replica to send to
        try:
            self.group = self._build(generation, rank=0)
            self.sender = self.make_sender(self.group)
        except _CAUGHT as err:
            if not is_collective_failure(err):
                raise
            self._fail(err)
            return
        log.info(
            "weight group generation %d: sending to %d rollout replica(s)",
            generation.number,
            generation.world_size - 1,
        )
        self.push(named_tensors(), version)

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        """Announce and start pushing `named_tensors` as `version` to the current generation's
        receivers; returns at once. A no-op without receivers or when `version` was pushed."""
        if not self._wait_pending():
            return
        if self.sender is None or (self.last_version is not None and version <= self.last_version):
            return
        assert self.generation is not None
        try:
            self.source.announce_push(self.generation.number)
            self._pending = self.sender.push(named_tensors, version)
            self.last_version = version
        except _CAUGHT as err:
            if not is_collective_failure(err):
                raise
            self._fail(err)

    def _wait_pending(self) -> bool:
        """Wait until the receivers took the push in flight (each push needs them back for the
        previous one). Gives the group up instead when a newer generation replaces it meanwhile,
        e.g. because a receiver hangs and was reaped. False if there is no group left."""
        while self._busy():
            assert self.generation is not None
            if self._superseded(self.generation):
                log.info(
                    "weight group generation %d was replaced during a push: leaving it",
                    self.generation.number,
                )
                self._leave()
                return False
            time.sleep(0.05)
        self._check_pending()
        return self.sender is not None

    def _check_pending(self) -> None:
        """A push that failed in the background breaks the group."""
        if self._pending is None or not self._pending.done():
            return
        pending, self._pending = self._pending, None
        try:
            pending.wait()
        except _CAUGHT as err:
            if not is_collective_failure(err):
                raise
            self._fail(err)

    def close(self) -> None:
        """Wait for the last push (a collective failure is only logged) and leave the group."""
        try:
            if self._pending is not None:
                try:
                    self._pending.wait()
                except _CAUGHT as err:
                    if not is_collective_failure(err):
                        raise
                    log.warning("the last weight push failed: %s", err)
        finally:
            self._leave()


class ElasticReceiver(_Member):
    """A rollout replica's side: joins each generation naming it and receives every push.

    `make_receiver` builds the :class:`WeightReceiver` on a new group (a collective with the
    sender); `apply(version, tensors)` takes each push (the tensors are views valid until the
    next receive).
    """

    def __init__(
        self,
        source: MembershipSource,
        name: str,
        *,
        make_receiver: Callable[[WeightGroup], WeightReceiver],
        apply: Callable[[int, dict[str, Tensor]], None],
        backend: CommBackend = "gloo",
        timeout: timedelta = timedelta(minutes=5),
        poll_s: float = 0.05,
    ) -> None:
        super().__init__(source, name, backend=backend, timeout=timeout)
        self.make_receiver, self.apply, self.poll_s = make_receiver, apply, poll_s
        self.receiver: WeightReceiver | None = None
        self.received = 0
        """Pushes received in the current generation."""

    def _drop(self) -> None:
        self.receiver, self.received = None, 0

    def run(self, stopped: Callable[[], bool]) -> None:
        """Follow generations and receive pushes until `stopped()`; raises only what no regroup
        can fix (a layout mismatch, an error of `make_receiver` or `apply` that is no collective
        failure)."""
        try:
            while not stopped():
                self.follow()
                time.sleep(self.poll_s)
        finally:
            self._leave()

    def follow(self) -> None:
        """One poll: join a new generation if it names this replica, then receive the pushes
        announced so far."""
        generation = current_generation(self.source)
        if _number(generation) != _number(self.generation):
            self._leave()
            self.generation = generation
            rank = None if generation is None else generation.rank_of(self.name)
            if generation is not None and rank is not None and rank > 0:
                try:
                    self.group = self._build(generation, rank=rank)
                    self.receiver = self.make_receiver(self.group)
                except _CAUGHT as err:
                    if not is_collective_failure(err):
                        raise
                    self._fail(err)
                    return
                log.info("joined weight group generation %d as rank %d", generation.number, rank)
        while self.receiver is not None and self.generation is not None:
            if self.received >= self.source.num_pushes(self.generation.number):
                return
            try:
                version, tensors = self.receiver.receive(timeout=self.timeout)
            except _CAUGHT as err:  # (a LayoutMismatchError is no collective failure)
                if not is_collective_failure(err):
                    raise
                self._fail(err)
                return
            self.received += 1
            self.apply(version, tensors)
