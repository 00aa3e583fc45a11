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
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import redis
from torch.distributed import DistError

from nebula_rl.weights.group import (
    CommBackend,
    Generation,
    GroupCancelled,
    WeightGroup,
    build_group,
    leave_group,
)
from nebula_rl.weights.reshard import ShardedReceiver, ShardedSender
from nebula_rl.weights.transport import CorruptedPushError, NamedTensors, PushHandle

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


_PUBLISHED = object()
"""`ElasticSender.refresh`'s default: follow the generation published now."""


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
        """Join `generation`'s group as `rank` (a collective with every member's processes)."""
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
    """The sender side, on every process of a policy replica: the processes of whichever replica
    a generation names first are its senders (group ranks 0..P-1, P = that replica's processes).

    `make_sender(group, num_senders)` builds the :class:`~nebula_rl.weights.reshard.
    ShardedSender` on a new group (with this process's parameters, DTensor shards included);
    building it is a collective with the receivers. `local_rank` is this process's rank in its
    replica. Every process of the replica calls `refresh` and `push` together.

    The first push of a generation sends every tensor; later ones only the trainable ones,
    unless `all_params` (`rollout.broadcast_all_params`).
    """

    def __init__(
        self,
        source: MembershipSource,
        name: str,
        *,
        make_sender: Callable[[WeightGroup, int], ShardedSender],
        local_rank: int = 0,
        all_params: bool = False,
        backend: CommBackend = "gloo",
        timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        super().__init__(source, name, backend=backend, timeout=timeout)
        self.make_sender, self.local_rank, self.all_params = make_sender, local_rank, all_params
        self.sender: ShardedSender | None = None
        self._pending: PushHandle | None = None
        self.last_version: int | None = None
        """Version of the last push started on the current group (None: none yet)."""

    def _busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def _drop(self) -> None:
        sender, self.sender, self._pending, self.last_version = self.sender, None, None, None
        if sender is not None:
            sender.abandon()

    def refresh(
        self,
        named_tensors: Callable[[], NamedTensors],
        version: int,
        *,
        generation: Generation | object | None = _PUBLISHED,
    ) -> None:
        """Follow the published generation: on a new one, leave the old group and, if this
        replica is its sender, build the group and push `named_tensors()` as `version`.

        The processes of a replica of several ranks must follow the same generation: their
        first reads it and hands it to the others as `generation` (by default each reads the
        published one itself)."""
        self._check_pending()
        if generation is _PUBLISHED:
            generation = current_generation(self.source)
        assert generation is None or isinstance(generation, Generation)
        if _number(generation) == _number(self.generation):
            return
        self._leave()
        self.generation = generation
        if generation is None or generation.rank_of(self.name) != 0:
            return
        if generation.world_size < 2:
            return  # no rollout replica to send to
        try:
            self.group = self._build(generation, rank=self.local_rank)
            self.sender = self.make_sender(self.group, generation.size_of(self.name))
        except _CAUGHT as err:
            if not is_collective_failure(err):
                raise
            self._fail(err)
            return
        log.info(
            "weight group generation %d: sending to %d rollout replica(s) (%d processes) over %s%s",
            generation.number,
            generation.world_size - 1,
            generation.num_processes - generation.size_of(self.name),
            self.backend,
            ", through shared memory" if self.sender.shared_memory else "",
        )
        self.push(named_tensors(), version)

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        """Announce and start pushing `named_tensors` as `version` to the current generation's
        receivers; returns once the tensors are copied out (shared memory) or sent. A no-op
        without receivers or when `version` was pushed."""
        if not self._wait_pending():
            return
        if self.sender is None or (self.last_version is not None and version <= self.last_version):
            return
        assert self.generation is not None
        try:
            if self.local_rank == 0:
                self.source.announce_push(self.generation.number)
            first = self.last_version is None
            self._pending = self.sender.push(
                named_tensors, version, trainable_only=not first and not self.all_params
            )
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
    """The receiver side, on a process of a rollout replica: joins each generation naming the
    replica (group rank: the replica's first rank plus `local_rank`) and takes every push.

    `make_receiver(group, num_senders)` builds the :class:`~nebula_rl.weights.reshard.
    ShardedReceiver` on a new group (a collective with the senders); `apply(receive)` takes each
    announced push, calling `receive()` (which writes the weights in place and returns their
    version, or None when the push failed part-way) where the engine can take them, e.g.
    `engine.update_weights_with(receive)`.

    With `membership_only`, `run`/`follow` only join and leave generations and never receive:
    the processes of a tensor-parallel replica other than its first take their pushes when their
    engine replays the first one's weight update (:meth:`receive_for`).
    """

    def __init__(
        self,
        source: MembershipSource,
        name: str,
        *,
        make_receiver: Callable[[WeightGroup, int], ShardedReceiver],
        apply: Callable[[Callable[[], int | None]], None],
        local_rank: int = 0,
        membership_only: bool = False,
        backend: CommBackend = "gloo",
        timeout: timedelta = timedelta(minutes=5),
        poll_s: float = 0.05,
    ) -> None:
        super().__init__(source, name, backend=backend, timeout=timeout)
        self.make_receiver, self.apply, self.poll_s = make_receiver, apply, poll_s
        self.local_rank, self.membership_only = local_rank, membership_only
        self.receiver: ShardedReceiver | None = None
        self.received = 0
        """Pushes received in the current generation."""

    def _drop(self) -> None:
        receiver, self.receiver, self.received = self.receiver, None, 0
        if receiver is not None:
            try:
                receiver.close()  # (the last acknowledgement, so the sender's push ends well)
            except _CAUGHT as err:
                if not is_collective_failure(err):
                    raise

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

    def run_in_background(self, stopped: Callable[[], bool]) -> list[BaseException]:
        """:meth:`run` in a daemon thread; the list it returns receives what the thread raised
        (the replica's main loop checks it and fails with it: supervised, not lost)."""
        errors: list[BaseException] = []

        def body() -> None:
            try:
                self.run(stopped=stopped)
            except BaseException as err:
                errors.append(err)

        threading.Thread(target=body, name="nebula-weights", daemon=True).start()
        return errors

    def follow(self) -> None:
        """One poll: join a new generation if it names this replica, then (unless
        `membership_only`) receive the pushes announced so far."""
        generation = current_generation(self.source)
        if _number(generation) != _number(self.generation):
            self._leave()
            self.generation = generation
            position = None if generation is None else generation.rank_of(self.name)
            if generation is not None and position is not None and position > 0:
                rank = generation.first_rank(self.name) + self.local_rank
                try:
                    self.group = self._build(generation, rank=rank)
                    self.receiver = self.make_receiver(self.group, generation.sizes[0])
                except _CAUGHT as err:
                    if not is_collective_failure(err):
                        raise
                    self._fail(err)
                    return
                log.info("joined weight group generation %d as rank %d", generation.number, rank)
        if self.membership_only:
            return
        while self.receiver is not None and self.generation is not None:
            if self.received >= self.source.num_pushes(self.generation.number):
                return
            if not self._take(self.receiver):
                return

    def _take(self, receiver: ShardedReceiver) -> bool:
        """Receive one push through `apply`; False when the group broke."""
        failure: list[BaseException] = []

        def receive() -> int | None:
            try:
                return receiver.receive(timeout=self.timeout)
            except _CAUGHT as err:  # (a LayoutMismatchError is no collective failure)
                if not is_collective_failure(err):
                    raise
                failure.append(err)
                return None

        self.apply(receive)
        if failure:
            self._fail(failure[0])
            return False
        self.received += 1
        return True

    def receive_for(self, generation: int, *, timeout_s: float) -> int | None:
        """`membership_only` processes: receive the next push of `generation` (the one the
        replica's first process is taking), once this process has joined it. None when it
        cannot (the generation broke or was replaced: the first process fails its receive
        alike), also when the push failed part-way."""
        deadline = time.monotonic() + timeout_s
        while (followed := _number(self.generation)) != generation or self.receiver is None:
            if followed is not None and followed > generation:
                return None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        receiver = self.receiver
        try:
            version = receiver.receive(timeout=self.timeout)
        except _CAUGHT as err:
            if not is_collective_failure(err):
                raise
            self._fail(err)
            return None
        self.received += 1
        return version
