"""The prompt ledger, the completion buffer and the training steps (see the package docstring
for the life of a prompt).

The buffer keeps each accepted group by prompt id as it was pushed, its JSON never decoded
here: `buffer` and `inflight` list prompt ids (oldest first), `bodies` and `headers` map a
buffered or in-flight prompt id to the group's JSON and to its
:class:`~nebula_rl.protocol.GroupHeader`, and `buffer_versions` (a sorted set) holds the policy
version of each buffered group, so the staleness filter finds the stale ones without reading the
others.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import replace
from typing import Any

from redis.client import Pipeline

from nebula_rl.controller.state._base import (
    CONTROLLER_GROUP,
    ROLLOUT_GROUP,
    PushedGroup,
    StateBase,
)
from nebula_rl.protocol import GroupHeader, Prompt, RolloutGroup, from_json, to_json

__all__ = ["LEDGER_STATES", "VERDICTS", "Ledger"]

log = logging.getLogger(__name__)

LEDGER_STATES = ("outstanding", "requeued", "completed", "filtered", "trained")
"""What the ledger records per dataset index: handed out, handed out again after a requeue,
accepted into the buffer, dropped by dynamic sampling, trained."""
VERDICTS = ("accepted", "stale", "duplicate", "filtered")
"""What :meth:`Ledger.judge_groups` decides about a training group."""


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
            requeued += self._requeue_held(prompts, msg_ids)
        if requeued:
            log.info("requeued %d prompts held by %s", requeued, consumer)
        return requeued

    def _requeue_held(self, prompts: list[Prompt], msg_ids: list[str]) -> int:
        """Requeue the unresolved ones of `prompts` and acknowledge their entries `msg_ids`, in
        one transaction; returns how many were requeued."""
        stream = self.key("prompts")

        def requeue(pipe: Pipeline) -> int:
            # Watched: a group that the controller (another process) accepts meanwhile must not
            # see its prompt requeued.
            states = [pipe.hget(self.key("ledger", p.epoch), p.index) for p in prompts]
            pipe.multi()
            held = [
                p for p, s in zip(prompts, states, strict=True) if s in ("outstanding", "requeued")
            ]
            for p in held:
                self._requeue(pipe, p)
            pipe.xack(stream, ROLLOUT_GROUP, *msg_ids)
            pipe.xdel(stream, *msg_ids)
            return len(held)

        ledgers = sorted({self.key("ledger", p.epoch) for p in prompts})
        return self.redis.transaction(requeue, *ledgers, value_from_callable=True)

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
        """A rollout replica hands in one prompt's completions; returns the stream id. The group
        goes with its header, the part the controller reads (see :class:`PushedGroup`)."""
        header = GroupHeader.of(group)
        return self.redis.xadd(
            self.key("groups"), {"header": to_json(header), "group": to_json(group)}
        )

    def read_groups(
        self, count: int, block_ms: int = 0, *, consumer: str = "controller"
    ) -> list[PushedGroup]:
        """Groups for the controller to judge (:meth:`judge_groups`), headers decoded, bodies
        as pushed.

        Groups read but not judged before a controller crash come first, so none is skipped.
        Entries without a readable header are logged and dropped.
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
                    out.append(_pushed(msg_id, fields))
                except (KeyError, TypeError, ValueError) as err:
                    log.warning("dropping undecodable group %s: %s", msg_id, err)
                    self._drop_message(msg_id)
        return out

    def poll_groups(
        self, count: int, block_ms: int = 0, *, consumer: str = "controller"
    ) -> list[tuple[str, RolloutGroup]]:
        """:meth:`read_groups`, each group decoded whole: (stream id, group)."""
        return [
            (g.msg_id, from_json(RolloutGroup, g.body))
            for g in self.read_groups(count, block_ms, consumer=consumer)
            if g.msg_id is not None
        ]

    def _drop_message(self, msg_id: str) -> None:
        with self.redis.pipeline() as pipe:
            pipe.xack(self.key("groups"), CONTROLLER_GROUP, msg_id)
            pipe.xdel(self.key("groups"), msg_id)
            pipe.execute()

    def judge_groups(
        self, pushed: list[PushedGroup], *, current_version: int, allowed_outdated_steps: int
    ) -> list[str]:
        """Judge training groups (no validation answers), in one transaction; returns the
        verdict of each (:data:`VERDICTS`).

        A group whose prompt_id was already accepted or filtered this epoch (also earlier in
        `pushed`) is a duplicate, dropped. Else a group the rollout filtered (dynamic sampling)
        resolves its prompt untrained. Else a stale one, `policy_version < current_version -
        allowed_outdated_steps`, is dropped and its prompt requeued. Else it is accepted: its
        JSON goes into the buffer as it was pushed. The stream entries are acknowledged in the
        same transaction, so a crash can neither lose a group nor count it twice; the sets of
        accepted prompts are watched, so a concurrent writer makes it start again.
        """
        if not pushed:
            return []
        oldest = current_version - allowed_outdated_steps
        by_epoch: dict[int, list[PushedGroup]] = defaultdict(list)
        for g in pushed:
            assert g.header.prompt.validation_step is None, "a validation answer"
            by_epoch[g.header.prompt.epoch].append(g)

        def judge(pipe: Pipeline) -> list[str]:
            taken = set()
            for epoch, groups in by_epoch.items():
                ids = [g.header.prompt.prompt_id for g in groups]
                members = pipe.smismember(self.key("accepted", epoch), ids)
                taken |= {i for i, member in zip(ids, members, strict=True) if member}
            verdicts = []
            for g in pushed:
                h = g.header
                if h.prompt.prompt_id in taken:
                    verdicts.append("duplicate")
                elif h.filtered:
                    verdicts.append("filtered")
                elif h.policy_version < oldest:
                    verdicts.append("stale")
                else:
                    verdicts.append("accepted")
                if verdicts[-1] in ("filtered", "accepted"):
                    taken.add(h.prompt.prompt_id)
            pipe.multi()
            self._write_verdicts(pipe, pushed, verdicts, current_version=current_version)
            self._ack_groups(pipe, pushed)
            return verdicts

        accepted_sets = [self.key("accepted", epoch) for epoch in by_epoch]
        return self.redis.transaction(judge, *accepted_sets, value_from_callable=True)

    def _write_verdicts(
        self,
        pipe: Pipeline,
        pushed: list[PushedGroup],
        verdicts: list[str],
        *,
        current_version: int,
    ) -> None:
        """Queue what `verdicts` decided about `pushed`: a few commands for the whole poll."""
        resolved: dict[int, dict[str, str]] = defaultdict(dict)  # epoch -> prompt_id -> state
        states: dict[int, dict[int, str]] = defaultdict(dict)  # epoch -> index -> ledger state
        counts: dict[tuple[int, str], int] = defaultdict(int)
        for g, verdict in zip(pushed, verdicts, strict=True):
            p = g.header.prompt
            if verdict == "duplicate":
                counts[p.epoch, "duplicates_dropped"] += 1
            elif verdict == "stale":
                counts[p.epoch, "stale_dropped"] += 1
                self._requeue(pipe, p, min_version=current_version)
            else:
                resolved[p.epoch][p.prompt_id] = verdict
                states[p.epoch][p.index] = "completed" if verdict == "accepted" else verdict
                if verdict == "filtered":  # (once per prompt: a resolved one is a duplicate)
                    counts[p.epoch, "groups_filtered"] += 1
        for (epoch, name), n in counts.items():
            pipe.hincrby(self.key("counters", epoch), name, n)
        for epoch, prompt_ids in resolved.items():
            pipe.sadd(self.key("accepted", epoch), *prompt_ids)
            pipe.hset(self.key("ledger", epoch), mapping=states[epoch])  # type: ignore[arg-type]
        if num_filtered := verdicts.count("filtered"):
            pipe.incrby(self.key("filtered_total"), num_filtered)
        buffered = {
            g.header.prompt.prompt_id: g
            for g, verdict in zip(pushed, verdicts, strict=True)
            if verdict == "accepted"
        }
        if buffered:
            pipe.rpush(self.key("buffer"), *buffered)
            pipe.hset(self.key("bodies"), mapping={i: g.body for i, g in buffered.items()})
            pipe.hset(self.key("headers"), mapping={i: g.header_json for i, g in buffered.items()})
            versions = {i: g.header.policy_version for i, g in buffered.items()}
            pipe.zadd(self.key("buffer_versions"), versions)  # type: ignore[arg-type]

    def accept_group(
        self,
        group: RolloutGroup,
        current_version: int,
        allowed_outdated_steps: int,
        *,
        msg_id: str | None = None,
    ) -> bool:
        """:meth:`judge_groups` for one group; True if accepted into the buffer."""
        verdicts = self.judge_groups(
            [PushedGroup.of(group, msg_id)],
            current_version=current_version,
            allowed_outdated_steps=allowed_outdated_steps,
        )
        return verdicts == ["accepted"]

    def filtered_total(self) -> int:
        """Groups dropped by dynamic sampling, over all epochs."""
        return int(self.redis.get(self.key("filtered_total")) or 0)

    def buffer_size(self) -> int:
        """Accepted groups waiting for a training batch."""
        return self.redis.llen(self.key("buffer"))

    def next_batch(
        self, size: int, *, current_version: int = 0, allowed_outdated_steps: int | None = None
    ) -> list[GroupHeader] | None:
        """The headers of the training batch in flight, else of the `size` oldest accepted
        groups (now in flight), else None.

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
            pipe.zrem(self.key("buffer_versions"), *batch)
            return batch

        batch = self.redis.transaction(take, buffer, inflight, value_from_callable=True)
        return None if batch is None else self._headers(batch)

    def _headers(self, prompt_ids: list[str]) -> list[GroupHeader]:
        """The headers of buffered or in-flight groups."""
        raw = self.redis.hmget(self.key("headers"), prompt_ids)
        assert None not in raw, f"groups without a header: {prompt_ids}"
        return [from_json(GroupHeader, h) for h in raw]

    def _drop_stale(self, current_version: int, allowed_outdated_steps: int) -> int:
        """Requeue the prompts of buffered groups older than the staleness bound (found by
        their versions alone)."""
        buffer, versions = self.key("buffer"), self.key("buffer_versions")
        oldest = current_version - allowed_outdated_steps

        def drop(pipe: Pipeline) -> int:
            stale = pipe.zrangebyscore(versions, "-inf", f"({oldest}")
            if not stale:
                return 0
            prompts = [
                from_json(GroupHeader, h).prompt for h in pipe.hmget(self.key("headers"), stale)
            ]
            pipe.multi()
            for prompt_id in stale:
                pipe.lrem(buffer, 1, prompt_id)
            pipe.zrem(versions, *stale)
            pipe.hdel(self.key("bodies"), *stale)
            pipe.hdel(self.key("headers"), *stale)
            for p in prompts:
                pipe.srem(self.key("accepted", p.epoch), p.prompt_id)
                pipe.hincrby(self.key("counters", p.epoch), "stale_dropped", 1)
                self._requeue(pipe, p, min_version=current_version)
            return len(stale)

        dropped = self.redis.transaction(drop, buffer, versions, value_from_callable=True)
        if dropped:
            log.info("dropped %d buffered groups older than version %d", dropped, oldest)
        return dropped

    def release_inflight(self, lost: list[str]) -> int:
        """Take the batch in flight back untrained: the groups of the prompts `lost` (their
        trajectories went with the replica that held them) are dropped and their prompts
        requeued, to be sampled again; the others return to the front of the buffer in their
        order. How many were dropped."""
        buffer, inflight = self.key("buffer"), self.key("inflight")
        versions, lost_ids = self.key("buffer_versions"), set(lost)

        def release(pipe: Pipeline) -> int:
            batch: list[str] = pipe.lrange(inflight, 0, -1)
            headers = [from_json(GroupHeader, h) for h in pipe.hmget(self.key("headers"), batch)]
            kept = [(i, h) for i, h in zip(batch, headers, strict=True) if i not in lost_ids]
            dropped = [h.prompt for i, h in zip(batch, headers, strict=True) if i in lost_ids]
            pipe.multi()
            if kept:
                pipe.lpush(buffer, *reversed([i for i, _ in kept]))
                pipe.zadd(versions, {i: h.policy_version for i, h in kept})
            if dropped:
                pipe.hdel(self.key("bodies"), *(p.prompt_id for p in dropped))
                pipe.hdel(self.key("headers"), *(p.prompt_id for p in dropped))
            for p in dropped:
                pipe.srem(self.key("accepted", p.epoch), p.prompt_id)
                pipe.hincrby(self.key("counters", p.epoch), "trajectories_lost", 1)
                self._requeue(pipe, p)
            pipe.delete(inflight, self.key("step_plan"))
            return len(dropped)

        return self.redis.transaction(release, inflight, buffer, value_from_callable=True)

    def prompt_states(self, prompts: list[Prompt]) -> list[str | None]:
        """The ledger's state of each prompt (:data:`LEDGER_STATES`; None: never handed out)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for p in prompts:
                pipe.hget(self.key("ledger", p.epoch), p.index)
            return list(pipe.execute())

    def inflight_batch(self) -> list[RolloutGroup]:
        """The training batch in flight (empty when none), decoded."""
        prompt_ids = self.redis.lrange(self.key("inflight"), 0, -1)
        if not prompt_ids:
            return []
        bodies = self.redis.hmget(self.key("bodies"), prompt_ids)
        return [from_json(RolloutGroup, body) for body in bodies if body is not None]

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
        inflight, headers = self.key("inflight"), self.key("headers")

        def finish(pipe: Pipeline) -> None:
            batch = pipe.lrange(inflight, 0, -1)
            if sorted(batch) != sorted(prompt_ids):
                raise ValueError(f"prompt_ids {prompt_ids} are not the batch in flight")
            prompts = [from_json(GroupHeader, h).prompt for h in pipe.hmget(headers, batch)]
            pipe.multi()
            for p in prompts:
                pipe.hset(self.key("ledger", p.epoch), p.index, "trained")
                pipe.hincrby(self.key("trained", p.epoch), p.index, 1)
            if batch:
                pipe.hdel(self.key("bodies"), *batch)
                pipe.hdel(headers, *batch)
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
        `trained_more_than_once` (must stay 0), and the `requeue_events`, `duplicates_dropped`,
        `stale_dropped` and `trajectories_lost` counters."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hvals(self.key("ledger", epoch))
            pipe.hvals(self.key("trained", epoch))
            pipe.hgetall(self.key("counters", epoch))
            states, trained, counters = pipe.execute()
        summary = {"total": len(states)}
        summary |= {s: states.count(s) for s in LEDGER_STATES}
        summary["trained_more_than_once"] = sum(int(n) > 1 for n in trained)
        for name in ("requeue_events", "duplicates_dropped", "stale_dropped", "trajectories_lost"):
            summary[name] = int(counters.get(name, 0))
        return summary

    def step_counters(self, epoch: int) -> dict[str, int]:
        """`stale_dropped` and `groups_filtered` of `epoch` so far: what a step's record needs,
        read from two counters rather than from the whole ledger as :meth:`ledger_summary`."""
        names = ("stale_dropped", "groups_filtered")
        values = self.redis.hmget(self.key("counters", epoch), list(names))
        return {name: int(v or 0) for name, v in zip(names, values, strict=True)}

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


def _pushed(msg_id: str, fields: dict[str, str]) -> PushedGroup:
    header = from_json(GroupHeader, fields["header"])
    if not header.rewards:
        raise ValueError("a group without completions")
    return PushedGroup(msg_id, header, fields["header"], fields["group"])
