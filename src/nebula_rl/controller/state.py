"""The job's durable state in Redis: prompt ledger, completion buffer, versions, replica registry.

Everything a restarted controller needs lives here, under keys prefixed `nebula:<job>:`; the
controller process itself keeps nothing it cannot rebuild from Redis.

Life of a prompt in an epoch (the ledger, `ledger:<epoch>`, maps dataset index -> state)::

    enqueue_prompts        -> outstanding   (XADD to the `prompts` stream)
    claim_prompts          -> a rollout replica holds it (pending in consumer group `rollout`)
    push_group + ack       -> its RolloutGroup waits in the `groups` stream
    accept_group           -> completed     (in the buffer)     or, if too stale, requeued
    mark_filtered          -> filtered      (dynamic sampling dropped its all-equal group)
    requeue_pending        -> requeued      (a dead replica's prompts go back to the stream)
    next_batch/mark_trained-> trained

Exactly once: a prompt may be generated more than once (a replica that was declared dead but was
only slow pushes its group anyway), but only the first group of each `prompt_id` is accepted
(`accepted:<epoch>` set), so it is trained once. Nothing is lost: a prompt leaves the streams only
when its group is accepted or it is put back as a new stream entry, in one transaction.

Training runs as commands: the controller appends a `train` command to each policy replica's
`commands:<replica>` stream, each replica reads its own (consumer group `policy`), trains on its
share of the in-flight batch and appends a result to the `results` stream, which the controller
reads (consumer group `controller`).

Elastic groups: the controller publishes each generation of the policy replicas' data-parallel
group and of the weight group (`group:<kind>`, see :meth:`JobState.publish_group`); members build
the group of the current generation, and a membership change publishes a new one. The step in
flight (`step_plan`) and every recorded step's metrics (`metrics`) live here too, so a restarted
controller re-sends what was in flight and rewrites no step twice.

Simplifications: one controller consumes the `groups` and `results` streams; one training batch
is in flight at a time; staleness is judged when a group is accepted and again when it is taken
into a batch.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import redis
from redis.client import Pipeline
from redis.exceptions import ResponseError

from nebula_rl.protocol import Prompt, RolloutGroup, from_json, to_json

__all__ = ["LEDGER_STATES", "JobState"]

log = logging.getLogger(__name__)

LEDGER_STATES = ("outstanding", "requeued", "completed", "filtered", "trained")
"""What the ledger records per dataset index: handed out, handed out again after a requeue,
accepted into the buffer, dropped by dynamic sampling, trained."""

ROLLOUT_GROUP = "rollout"
"""Consumer group of rollout replicas on the `prompts` stream."""
CONTROLLER_GROUP = "controller"
"""Consumer group of the controller on the `groups` and `results` streams."""
POLICY_GROUP = "policy"
"""Consumer group of a policy replica on its `commands:<replica>` stream."""

_JOB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KINDS = ("policy", "weights")


class JobState:
    """All durable controller state of job `job`, kept in Redis.

    `redis` must decode responses to `str` (see :func:`nebula_rl.controller.connect`). `clock`
    gives heartbeat times in seconds; tests pass a fake one.
    """

    def __init__(
        self, redis: redis.Redis, job: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        if not _JOB_NAME.fullmatch(job):
            raise ValueError(f"job name {job!r} must be 1-64 characters of [A-Za-z0-9_.-]")
        if not redis.get_connection_kwargs().get("decode_responses"):
            raise ValueError("JobState needs a Redis client with decode_responses=True")
        self.redis = redis
        self.job = job
        self.clock = clock
        self.prefix = f"nebula:{job}:"
        self._groups: set[tuple[str, str]] = set()
        for stream, group in (
            (self.key("prompts"), ROLLOUT_GROUP),
            (self.key("groups"), CONTROLLER_GROUP),
            (self.key("results"), CONTROLLER_GROUP),
        ):
            try:
                redis.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    def key(self, *parts: object) -> str:
        """`nebula:<job>:<part>:<part>...`."""
        return self.prefix + ":".join(str(p) for p in parts)

    # -- checkpoints ----------------------------------------------------------------------------

    def _binary(self) -> redis.Redis:
        """A client on the same server that returns bytes (DUMP payloads are not text)."""
        pool = self.redis.connection_pool
        kwargs = {**pool.connection_kwargs, "decode_responses": False}
        return redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        )

    def snapshot(self) -> dict[str, str]:
        """Every key of this job as Redis serialises it (DUMP, base64), by its name without the
        job prefix, taken atomically (one script): streams keep their consumer groups and
        pending entries. A checkpoint stores it so that :meth:`restore` puts the job back
        exactly where it was (under this or another job name)."""
        script = (
            "local out = {} "
            "for _, k in ipairs(redis.call('KEYS', ARGV[1])) do "
            "out[#out + 1] = k; out[#out + 1] = redis.call('DUMP', k) end "
            "return out"
        )
        client = self._binary()
        try:
            flat = client.eval(script, 0, self.prefix.encode() + b"*")
        finally:
            client.close()
        return {
            flat[i].decode().removeprefix(self.prefix): base64.b64encode(flat[i + 1]).decode()
            for i in range(0, len(flat), 2)
        }

    def restore(self, snapshot: dict[str, str]) -> None:
        """Replace every key of this job by those of `snapshot`, in one transaction; then, since
        the replicas of that moment are gone, unregister them and requeue the prompts they held."""
        client = self._binary()
        try:
            with client.pipeline(transaction=True) as pipe:
                for k in client.keys(self.prefix.encode() + b"*"):
                    pipe.delete(k)
                for k, payload in snapshot.items():
                    pipe.restore(self.prefix + k, 0, base64.b64decode(payload), replace=True)
                pipe.execute()
        finally:
            client.close()
        self._groups.clear()
        for consumer in self.redis.xinfo_consumers(self.key("prompts"), ROLLOUT_GROUP):
            self.requeue_pending(consumer["name"])
        for name in self.replicas():
            self.unregister_replica(name)
        # Their groups went with them (generation numbers keep growing: the counters stay).
        self.redis.delete(*(self.key(k, kind) for k in ("group", "regroup") for kind in _KINDS))

    # -- prompts --------------------------------------------------------------------------------

    def enqueue_prompts(self, prompts: list[Prompt]) -> int:
        """Hand out prompts the ledger has not seen yet; returns how many were enqueued.

        Idempotent, so a restarted controller can enqueue its epoch again without duplicates.
        """
        by_epoch: dict[int, list[Prompt]] = {}
        for p in prompts:
            by_epoch.setdefault(p.epoch, []).append(p)
        ledgers = [self.key("ledger", epoch) for epoch in by_epoch]

        def enqueue(pipe: Pipeline) -> int:
            new = [
                p
                for epoch, group in by_epoch.items()
                for p, state in zip(
                    group,
                    pipe.hmget(self.key("ledger", epoch), [p.index for p in group]),
                    strict=True,
                )
                if state is None
            ]
            pipe.multi()
            for p in new:
                pipe.xadd(self.key("prompts"), {"prompt": to_json(p)})
                pipe.hset(self.key("ledger", p.epoch), p.index, "outstanding")
            if by_epoch:
                pipe.sadd(self.key("epochs"), *by_epoch)
            return len(new)

        return self.redis.transaction(enqueue, *ledgers, value_from_callable=True)

    def claim_prompts(
        self, consumer: str, count: int, block_ms: int = 0
    ) -> list[tuple[str, Prompt]]:
        """Take up to `count` prompts for rollout replica `consumer`: (stream id, prompt) pairs.

        Waits up to `block_ms` for one to arrive (0: return at once). The prompts stay pending for
        `consumer` until :meth:`ack_prompts`, or until :meth:`requeue_pending` gives them back.
        """
        reply = self.redis.xreadgroup(
            ROLLOUT_GROUP, consumer, {self.key("prompts"): ">"}, count=count, block=block_ms or None
        )
        return [
            (msg_id, from_json(Prompt, f["prompt"]))
            for _, entries in reply
            for msg_id, f in entries
        ]

    def ack_prompts(self, msg_ids: list[str]) -> None:
        """A rollout replica is done with these prompts (their groups are pushed)."""
        if msg_ids:
            with self.redis.pipeline() as pipe:
                pipe.xack(self.key("prompts"), ROLLOUT_GROUP, *msg_ids)
                pipe.xdel(self.key("prompts"), *msg_ids)
                pipe.execute()

    def requeue_pending(self, consumer: str) -> int:
        """Put the prompts `consumer` holds back on the stream, e.g. when it died; returns how many.

        Each one becomes a new stream entry and the old one is acknowledged, in one transaction,
        so any replica can take it and none is lost. Prompts whose group was already accepted are
        only acknowledged.
        """
        stream, requeued = self.key("prompts"), 0
        while pending := self.redis.xpending_range(stream, ROLLOUT_GROUP, "-", "+", 1000, consumer):
            msg_ids = [p["message_id"] for p in pending]
            with self.redis.pipeline(transaction=False) as pipe:
                for msg_id in msg_ids:
                    pipe.xrange(stream, msg_id, msg_id)
                prompts = [from_json(Prompt, e[0][1]["prompt"]) for e in pipe.execute() if e]
            states = [self._state(p) for p in prompts]
            with self.redis.pipeline() as pipe:  # MULTI/EXEC
                for p, state in zip(prompts, states, strict=True):
                    if state in ("outstanding", "requeued"):
                        self._requeue(pipe, p)
                        requeued += 1
                pipe.xack(stream, ROLLOUT_GROUP, *msg_ids)
                pipe.xdel(stream, *msg_ids)
                pipe.execute()
        if requeued:
            log.info("requeued %d prompts held by %s", requeued, consumer)
        return requeued

    def _state(self, prompt: Prompt) -> str | None:
        return self.redis.hget(self.key("ledger", prompt.epoch), prompt.index)

    def released(self) -> int:
        """Prompts handed out so far, over all epochs (each dataset row counts once per epoch)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for epoch in self.epochs():
                pipe.hlen(self.key("ledger", epoch))
            return sum(pipe.execute())

    def _requeue(self, pipe: Pipeline, prompt: Prompt, *, min_version: int | None = None) -> None:
        if min_version is not None:
            prompt = replace(prompt, min_version=max(prompt.min_version, min_version))
        pipe.xadd(self.key("prompts"), {"prompt": to_json(prompt)})
        pipe.hset(self.key("ledger", prompt.epoch), prompt.index, "requeued")
        pipe.hincrby(self.key("counters", prompt.epoch), "requeue_events", 1)

    # -- completions ----------------------------------------------------------------------------

    def push_group(self, group: RolloutGroup) -> str:
        """A rollout replica hands in one prompt's completions; returns the stream id."""
        return self.redis.xadd(self.key("groups"), {"group": to_json(group)})

    def poll_groups(
        self, count: int, block_ms: int = 0, *, consumer: str = "controller"
    ) -> list[tuple[str, RolloutGroup]]:
        """Groups for the controller to judge with :meth:`accept_group`: (stream id, group).

        Groups read but not judged before a controller crash come first, so none is skipped.
        Undecodable entries are logged and dropped.
        """
        stream = self.key("groups")
        reply = self.redis.xreadgroup(CONTROLLER_GROUP, consumer, {stream: "0"}, count=count)
        if not reply or not reply[0][1]:
            reply = self.redis.xreadgroup(
                CONTROLLER_GROUP, consumer, {stream: ">"}, count=count, block=block_ms or None
            )
        out = []
        for _, entries in reply:
            for msg_id, fields in entries:
                try:
                    out.append((msg_id, _decode_group(fields)))
                except (KeyError, TypeError, ValueError) as err:
                    log.warning("dropping undecodable group %s: %s", msg_id, err)
                    self._drop_message(msg_id)
        return out

    def _drop_message(self, msg_id: str) -> None:
        with self.redis.pipeline() as pipe:
            pipe.xack(self.key("groups"), CONTROLLER_GROUP, msg_id)
            pipe.xdel(self.key("groups"), msg_id)
            pipe.execute()

    def accept_group(
        self,
        group: RolloutGroup,
        current_version: int,
        allowed_outdated_steps: int,
        *,
        msg_id: str | None = None,
    ) -> bool:
        """Put `group` into the buffer unless it is a duplicate or too stale; True if accepted.

        Stale means `group.policy_version < current_version - allowed_outdated_steps`; a stale
        group is dropped and its prompt requeued. A group whose prompt_id was already accepted
        this epoch is dropped. `msg_id` (from :meth:`poll_groups`) is acknowledged in the same
        transaction, so a crash can neither lose the group nor count it twice.
        """
        p = group.prompt
        accepted, counters = self.key("accepted", p.epoch), self.key("counters", p.epoch)
        stale = group.policy_version < current_version - allowed_outdated_steps

        def decide(pipe: Pipeline) -> bool:
            duplicate = pipe.sismember(accepted, p.prompt_id)
            pipe.multi()
            if duplicate:
                pipe.hincrby(counters, "duplicates_dropped", 1)
            elif stale:
                pipe.hincrby(counters, "stale_dropped", 1)
                self._requeue(pipe, p, min_version=current_version)
            else:
                pipe.sadd(accepted, p.prompt_id)
                pipe.rpush(self.key("buffer"), to_json(group))
                pipe.hset(self.key("ledger", p.epoch), p.index, "completed")
            if msg_id is not None:
                pipe.xack(self.key("groups"), CONTROLLER_GROUP, msg_id)
                pipe.xdel(self.key("groups"), msg_id)
            return not duplicate and not stale

        return self.redis.transaction(decide, accepted, value_from_callable=True)

    def mark_filtered(self, group: RolloutGroup, *, msg_id: str | None = None) -> bool:
        """Dynamic sampling dropped `group` (all rewards equal): its prompt is done, untrained.

        False if the prompt's group was already accepted or filtered (a duplicate)."""
        p = group.prompt
        accepted, counters = self.key("accepted", p.epoch), self.key("counters", p.epoch)

        def decide(pipe: Pipeline) -> bool:
            duplicate = pipe.sismember(accepted, p.prompt_id)
            pipe.multi()
            if duplicate:
                pipe.hincrby(counters, "duplicates_dropped", 1)
            else:
                pipe.sadd(accepted, p.prompt_id)
                pipe.hset(self.key("ledger", p.epoch), p.index, "filtered")
                pipe.incr(self.key("filtered_total"))
            if msg_id is not None:
                pipe.xack(self.key("groups"), CONTROLLER_GROUP, msg_id)
                pipe.xdel(self.key("groups"), msg_id)
            return not duplicate

        return self.redis.transaction(decide, accepted, value_from_callable=True)

    def filtered_total(self) -> int:
        """Groups dropped by dynamic sampling, over all epochs."""
        return int(self.redis.get(self.key("filtered_total")) or 0)

    # -- training batches -----------------------------------------------------------------------

    def buffer_size(self) -> int:
        """Accepted groups waiting for a training batch."""
        return self.redis.llen(self.key("buffer"))

    def next_batch(
        self, size: int, *, current_version: int = 0, allowed_outdated_steps: int | None = None
    ) -> list[RolloutGroup] | None:
        """The training batch in flight, else the `size` oldest accepted groups, else None.

        A batch stays in flight (`inflight` list) until :meth:`mark_trained`; asking again
        returns the same batch, so a restarted controller re-issues it instead of losing it.
        With `allowed_outdated_steps`, buffered groups that became too stale for training at
        `current_version` are dropped first and their prompts requeued.
        """
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        buffer, inflight = self.key("buffer"), self.key("inflight")
        if allowed_outdated_steps is not None and not self.redis.exists(inflight):
            self._drop_stale(current_version, allowed_outdated_steps)

        def take(pipe: Pipeline) -> list[str] | None:
            batch = pipe.lrange(inflight, 0, -1)
            if batch:
                return batch
            if pipe.llen(buffer) < size:
                return None
            batch = pipe.lrange(buffer, 0, size - 1)
            pipe.multi()
            pipe.ltrim(buffer, size, -1)
            pipe.rpush(inflight, *batch)
            return batch

        batch = self.redis.transaction(take, buffer, inflight, value_from_callable=True)
        return None if batch is None else [from_json(RolloutGroup, g) for g in batch]

    def _drop_stale(self, current_version: int, allowed_outdated_steps: int) -> int:
        """Requeue the prompts of buffered groups older than the staleness bound."""
        buffer, oldest = self.key("buffer"), current_version - allowed_outdated_steps

        def drop(pipe: Pipeline) -> int:
            entries = pipe.lrange(buffer, 0, -1)
            stale = [
                (raw, group)
                for raw in entries
                if (group := from_json(RolloutGroup, raw)).policy_version < oldest
            ]
            pipe.multi()
            for raw, group in stale:
                p = group.prompt
                pipe.lrem(buffer, 1, raw)
                pipe.srem(self.key("accepted", p.epoch), p.prompt_id)
                pipe.hincrby(self.key("counters", p.epoch), "stale_dropped", 1)
                self._requeue(pipe, p, min_version=current_version)
            return len(stale)

        dropped = self.redis.transaction(drop, buffer, value_from_callable=True)
        if dropped:
            log.info("dropped %d buffered groups older than version %d", dropped, oldest)
        return dropped

    def inflight_batch(self) -> list[RolloutGroup]:
        """The training batch in flight (empty when none)."""
        return [from_json(RolloutGroup, g) for g in self.redis.lrange(self.key("inflight"), 0, -1)]

    def mark_trained(
        self,
        prompt_ids: list[str],
        step: int,
        *,
        policy_version: int | None = None,
        record: dict[str, Any] | None = None,
    ) -> None:
        """The in-flight batch (these prompt_ids) was trained by optimiser step `step`.

        In the same transaction: the step plan is cleared, the policy version set to
        `policy_version` and the step's metrics `record` appended (see :meth:`step_records`), so a
        controller that dies at any point records the step exactly once.
        """
        inflight = self.key("inflight")

        def finish(pipe: Pipeline) -> None:
            prompts = [from_json(RolloutGroup, g).prompt for g in pipe.lrange(inflight, 0, -1)]
            if sorted(p.prompt_id for p in prompts) != sorted(prompt_ids):
                raise ValueError(f"prompt_ids {prompt_ids} are not the batch in flight")
            pipe.multi()
            for p in prompts:
                pipe.hset(self.key("ledger", p.epoch), p.index, "trained")
                pipe.hincrby(self.key("trained", p.epoch), p.index, 1)
            pipe.delete(inflight, self.key("step_plan"))
            pipe.set(self.key("step"), step)
            if policy_version is not None:
                pipe.set(self.key("policy_version"), policy_version)
            if record is not None:
                pipe.rpush(self.key("metrics"), json.dumps(record))

        self.redis.transaction(finish, inflight)

    def step_records(self, start: int = 0) -> list[dict[str, Any]]:
        """The metrics of the recorded steps, in order, from the `start`-th on."""
        return [json.loads(r) for r in self.redis.lrange(self.key("metrics"), start, -1)]

    def save_step_plan(self, plan: dict[str, Any]) -> None:
        """What the controller needs to finish the step in flight after a restart (JSON-able)."""
        self.redis.set(self.key("step_plan"), json.dumps(plan))

    def step_plan(self) -> dict[str, Any] | None:
        """The step in flight as saved by :meth:`save_step_plan`; None when none runs."""
        raw = self.redis.get(self.key("step_plan"))
        return None if raw is None else json.loads(raw)

    def ledger_summary(self, epoch: int) -> dict[str, int]:
        """Counts for `epoch`: `total` prompts, how many are in each of :data:`LEDGER_STATES`,
        `trained_more_than_once` (must stay 0), and the `requeue_events`, `duplicates_dropped`
        and `stale_dropped` counters."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hvals(self.key("ledger", epoch))
            pipe.hvals(self.key("trained", epoch))
            pipe.hgetall(self.key("counters", epoch))
            states, trained, counters = pipe.execute()
        summary = {"total": len(states)}
        summary |= {s: states.count(s) for s in LEDGER_STATES}
        summary["trained_more_than_once"] = sum(int(n) > 1 for n in trained)
        for name in ("requeue_events", "duplicates_dropped", "stale_dropped"):
            summary[name] = int(counters.get(name, 0))
        return summary

    def trained_counts(self, epoch: int) -> dict[int, int]:
        """Dataset index -> how many optimiser steps trained its group in `epoch` (must be 1)."""
        counts = self.redis.hgetall(self.key("trained", epoch))
        return {int(index): int(n) for index, n in counts.items()}

    def epochs(self) -> list[int]:
        """Epochs that have prompts in the ledger."""
        return sorted(int(e) for e in self.redis.smembers(self.key("epochs")))

    # -- commands to the policy, results back ---------------------------------------------------

    def _ensure_group(self, stream: str, group: str) -> None:
        if (stream, group) in self._groups:
            return
        try:
            self.redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
        self._groups.add((stream, group))

    def send_command(self, command: dict[str, Any], *, to: str) -> str:
        """Append a command for policy replica `to` (each replica has its own stream, so a
        command reaches exactly that replica and stays pending until it acknowledges it);
        returns its stream id."""
        stream = self.key("commands", to)
        self._ensure_group(stream, POLICY_GROUP)
        return self.redis.xadd(stream, {"command": json.dumps(command)})

    def read_commands(
        self, consumer: str, *, count: int = 1, block_ms: int = 0
    ) -> list[tuple[str, dict[str, Any]]]:
        """Commands for policy replica `consumer`: unacknowledged ones it already read first (it
        restarted mid-command), then new ones, waiting up to `block_ms`."""
        stream = self.key("commands", consumer)
        self._ensure_group(stream, POLICY_GROUP)
        reply = self.redis.xreadgroup(POLICY_GROUP, consumer, {stream: "0"}, count=count)
        if not reply or not reply[0][1]:
            reply = self.redis.xreadgroup(
                POLICY_GROUP, consumer, {stream: ">"}, count=count, block=block_ms or None
            )
        return [(i, json.loads(f["command"])) for _, entries in reply for i, f in entries]

    def ack_command(self, consumer: str, msg_id: str) -> None:
        """Policy replica `consumer` carried the command out."""
        self.redis.xack(self.key("commands", consumer), POLICY_GROUP, msg_id)

    def push_result(self, result: dict[str, Any]) -> str:
        """A policy replica reports a finished command (e.g. a step and its metrics)."""
        return self.redis.xadd(self.key("results"), {"result": json.dumps(result)})

    def poll_results(self, *, block_ms: int = 0) -> list[tuple[str, dict[str, Any]]]:
        """Results for the controller, unacknowledged ones first (see :meth:`poll_groups`)."""
        stream = self.key("results")
        reply = self.redis.xreadgroup(CONTROLLER_GROUP, "controller", {stream: "0"}, count=16)
        if not reply or not reply[0][1]:
            reply = self.redis.xreadgroup(
                CONTROLLER_GROUP, "controller", {stream: ">"}, count=16, block=block_ms or None
            )
        return [(i, json.loads(f["result"])) for _, entries in reply for i, f in entries]

    def ack_result(self, msg_id: str) -> None:
        """The controller recorded the result."""
        self.redis.xack(self.key("results"), CONTROLLER_GROUP, msg_id)

    def finish(self, outcome: str = "done") -> None:
        """The job ended (`done` or a failure reason); replicas see it and exit."""
        self.redis.set(self.key("finished"), outcome)

    def finished(self) -> str | None:
        """The job's outcome once it ended, else None."""
        return self.redis.get(self.key("finished"))

    # -- versions -------------------------------------------------------------------------------

    def policy_version(self) -> int:
        """Version of the newest policy weights (0 before the first update)."""
        return int(self.redis.get(self.key("policy_version")) or 0)

    def bump_policy_version(self) -> int:
        """New weights exist; returns the new version."""
        return self.redis.incr(self.key("policy_version"))

    def step(self) -> int:
        """Last optimiser step recorded by :meth:`mark_trained` (0 before the first)."""
        return int(self.redis.get(self.key("step")) or 0)

    # -- replica registry -----------------------------------------------------------------------

    def register_replica(
        self, name: str, *, role: Literal["policy", "rollout"], host: str, world_size: int
    ) -> int:
        """Add (or re-add, after a restart) replica `name`; returns a new, job-unique replica id."""
        replica_id = self.redis.incr(self.key("replica_seq"))
        now = self.clock()
        info = {
            "replica_id": replica_id,
            "role": role,
            "host": host,
            "world_size": world_size,
            "registered_at": now,
            "last_heartbeat": now,
            "policy_version": -1,
            "stats": "{}",
        }
        with self.redis.pipeline() as pipe:
            pipe.delete(self.key("replica", name))
            pipe.hset(self.key("replica", name), mapping=info)
            pipe.zadd(self.key("replicas"), {name: now})
            pipe.execute()
        return replica_id

    def heartbeat(self, name: str, *, policy_version: int, stats: dict[str, float]) -> bool:
        """Replica `name` is alive, holding weights `policy_version`; False if not registered."""
        replica = self.key("replica", name)

        def beat(pipe: Pipeline) -> bool:
            if not pipe.exists(replica):
                return False
            now = self.clock()
            pipe.multi()
            pipe.hset(
                replica,
                mapping={
                    "last_heartbeat": now,
                    "policy_version": policy_version,
                    "stats": json.dumps(stats),
                },
            )
            pipe.zadd(self.key("replicas"), {name: now})
            return True

        return self.redis.transaction(beat, replica, value_from_callable=True)

    def set_ready(self, name: str) -> bool:
        """Replica `name` has loaded its model and can join groups now; False if unregistered."""
        replica = self.key("replica", name)

        def mark(pipe: Pipeline) -> bool:
            if not pipe.exists(replica):
                return False
            pipe.multi()
            pipe.hset(replica, "ready", 1)
            return True

        return self.redis.transaction(mark, replica, value_from_callable=True)

    def refresh_heartbeats(self) -> None:
        """Count every registered replica as having just beaten: a restarted controller gives
        them a full timeout to reach it before judging them dead."""
        now = self.clock()
        names: list[str] = self.redis.zrange(self.key("replicas"), 0, -1)
        with self.redis.pipeline() as pipe:
            for name in names:
                pipe.zadd(self.key("replicas"), {name: now}, xx=True)
                pipe.hset(self.key("replica", name), "last_heartbeat", now)
            pipe.execute()

    def unregister_replica(self, name: str) -> bool:
        """Forget replica `name`; False if it was not registered. Its prompts are not requeued
        here: see :meth:`requeue_pending`."""
        with self.redis.pipeline() as pipe:
            pipe.delete(self.key("replica", name))
            pipe.zrem(self.key("replicas"), name)
            deleted, _ = pipe.execute()
        return bool(deleted)

    def replicas(self) -> dict[str, dict[str, Any]]:
        """Registered replicas: name -> {replica_id, role, host, world_size, registered_at,
        last_heartbeat, policy_version, stats, ready}."""
        names = self.redis.zrange(self.key("replicas"), 0, -1)
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self.key("replica", name))
            infos = pipe.execute()
        return {
            name: _decode_replica(info) for name, info in zip(names, infos, strict=True) if info
        }

    # -- elastic groups -------------------------------------------------------------------------

    def group_record(self, kind: str) -> dict[str, Any] | None:
        """The current generation of group `kind` ("policy" or "weights"): {kind, generation,
        members (rank order), ids (their replica ids), host, port (the rendezvous store), job,
        confirmed (member -> what it reported on joining)}; None before the first."""
        raw = self.redis.get(self.key("group", kind))
        return None if raw is None else json.loads(raw)

    def publish_group(
        self, kind: str, members: list[str], *, host: str, port: int, ids: dict[str, int]
    ) -> dict[str, Any]:
        """Start a new generation of group `kind` with `members` (in rank order; `ids`: their
        replica ids, which tell a member from a new process under the same name); returns its
        record. Generation numbers only grow (also across controller restarts)."""
        if kind not in _KINDS:
            raise ValueError(f"group kind must be one of {_KINDS}, got {kind!r}")
        record = {
            "kind": kind,
            "generation": self.redis.incr(self.key("group_seq", kind)),
            "members": members,
            "ids": {name: ids[name] for name in members},
            "host": host,
            "port": port,
            "job": self.job,
            "confirmed": {},
        }
        self.redis.set(self.key("group", kind), json.dumps(record))
        return record

    def confirm_member(
        self, kind: str, generation: int, name: str, info: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Member `name` joined generation `generation` of `kind` and reports `info`; returns the
        updated record, or None when that generation is no longer current."""
        group = self.key("group", kind)

        def confirm(pipe: Pipeline) -> dict[str, Any] | None:
            raw = pipe.get(group)
            record = None if raw is None else json.loads(raw)
            if record is None or record["generation"] != generation:
                return None
            record["confirmed"][name] = info
            pipe.multi()
            pipe.set(group, json.dumps(record))
            return record

        return self.redis.transaction(confirm, group, value_from_callable=True)

    def request_regroup(self, kind: str, generation: int) -> None:
        """A member found generation `generation` of `kind` broken (a collective failed or
        timed out); the controller rebuilds the group among the live members."""
        self.redis.eval(
            "local old = tonumber(redis.call('GET', KEYS[1]) or '-1') "
            "if tonumber(ARGV[1]) > old then redis.call('SET', KEYS[1], ARGV[1]) end",
            1,
            self.key("regroup", kind),
            generation,
        )

    def regroup_requested(self, kind: str) -> int:
        """The newest generation of `kind` a member asked to replace (-1: none)."""
        return int(self.redis.get(self.key("regroup", kind)) or -1)

    def announce_push(self, generation: int) -> int:
        """The weight sender is about to push in weight-group generation `generation`; returns
        how many pushes that generation has seen, this one included. Receivers take part in
        exactly that many (:meth:`num_pushes`)."""
        return self.redis.incr(self.key("pushes", generation))

    def num_pushes(self, generation: int) -> int:
        """Pushes announced so far in weight-group generation `generation`."""
        return int(self.redis.get(self.key("pushes", generation)) or 0)

    def dead_replicas(self, timeout: float) -> list[str]:
        """Replicas whose last heartbeat is more than `timeout` seconds old."""
        return self.redis.zrangebyscore(self.key("replicas"), "-inf", f"({self.clock() - timeout}")

    def reap_dead_replicas(self, timeout: float) -> list[str]:
        """Unregister replicas silent for `timeout` seconds and requeue their prompts."""
        dead = self.dead_replicas(timeout)
        for name in dead:
            log.warning("replica %s missed heartbeats for %.0f s: removing it", name, timeout)
            self.requeue_pending(name)
            self.unregister_replica(name)
        return dead


def _decode_group(fields: dict[str, str]) -> RolloutGroup:
    group = from_json(RolloutGroup, fields["group"])
    if not group.completions:
        raise ValueError("a group without completions")
    return group


def _decode_replica(info: dict[str, str]) -> dict[str, Any]:
    return {
        "replica_id": int(info["replica_id"]),
        "role": info["role"],
        "host": info["host"],
        "world_size": int(info["world_size"]),
        "registered_at": float(info["registered_at"]),
        "last_heartbeat": float(info["last_heartbeat"]),
        "policy_version": int(info["policy_version"]),
        "stats": json.loads(info["stats"]),
        "ready": info.get("ready") == "1",
    }
