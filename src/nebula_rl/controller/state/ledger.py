"""The prompt ledger, the completion buffer and the training steps (see the package docstring
for the life of a prompt)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

from redis.client import Pipeline

from nebula_rl.controller.state._base import CONTROLLER_GROUP, ROLLOUT_GROUP, StateBase
from nebula_rl.protocol import Prompt, RolloutGroup, from_json, to_json

__all__ = ["LEDGER_STATES", "Ledger"]

log = logging.getLogger(__name__)

LEDGER_STATES = ("outstanding", "requeued", "completed", "filtered", "trained")
"""What the ledger records per dataset index: handed out, handed out again after a requeue,
accepted into the buffer, dropped by dynamic sampling, trained."""


class Ledger(StateBase):
    """Prompts handed out and resolved exactly once, the buffer of accepted groups, the batch in
    flight, the recorded steps and the policy version."""

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

    def finish(self, outcome: str = "done") -> None:
        """The job ended (`done` or a failure reason); replicas see it and exit."""
        self.redis.set(self.key("finished"), outcome)

    def finished(self) -> str | None:
        """The job's outcome once it ended, else None."""
        return self.redis.get(self.key("finished"))

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint after the next step (`train.save_ckpt_at_exit`: a process of the
        job received one of `train.signal_to_handle`)."""
        self.redis.set(self.key("checkpoint_requested"), 1)

    def take_checkpoint_request(self) -> bool:
        """Whether a checkpoint was asked for since the last call (the request is consumed)."""
        return self.redis.getdel(self.key("checkpoint_requested")) is not None

    def policy_version(self) -> int:
        """Version of the newest policy weights (0 before the first update)."""
        return int(self.redis.get(self.key("policy_version")) or 0)

    def bump_policy_version(self) -> int:
        """New weights exist; returns the new version."""
        return self.redis.incr(self.key("policy_version"))

    def step(self) -> int:
        """Last optimiser step recorded by :meth:`mark_trained` (0 before the first)."""
        return int(self.redis.get(self.key("step")) or 0)


def _decode_group(fields: dict[str, str]) -> RolloutGroup:
    group = from_json(RolloutGroup, fields["group"])
    if not group.completions:
        raise ValueError("a group without completions")
    return group
