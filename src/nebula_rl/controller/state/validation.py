"""Validation prompts and their answers, apart from the training ledger.

A validation of step `s` hands out one prompt per validation row on the `val_prompts` stream
(consumer group `rollout`, like the training prompts) and tracks them in `val_ledger:<s>` (row
index -> `outstanding`, `requeued` or `done`). Rollout replicas push their groups to the same
`groups` stream as training groups (the prompt's `validation_step` tells them apart); the
controller keeps the first answer of each row (`val_results:<s>`, in the same transaction as the
acknowledgement) and drops duplicates, and a dead replica's validation prompts go back to the
stream: every validation prompt is answered exactly once, as a training prompt is trained once.
When every row of step `s` is answered, the controller appends the step's `val/*` record to the
`metrics` list and takes `s` off `val_pending`, in one transaction, so a restarted controller
records it exactly once. Nothing here touches the training ledger, the buffer or the counts of
released prompts.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from redis.client import Pipeline

from nebula_rl.controller.state._base import ROLLOUT_GROUP, PushedGroup, StateBase
from nebula_rl.protocol import GroupHeader, Prompt, from_json, to_json

__all__ = ["Validation"]

log = logging.getLogger(__name__)


class Validation(StateBase):
    """The validation prompts of each validated step, their answers, the steps pending."""

    def enqueue_validation(self, step: int, prompts: list[Prompt]) -> bool:
        """Hand out the validation prompts of `step` (every one has `validation_step == step`);
        False, and nothing happens, when they were handed out before (idempotent)."""
        steps, pending = self.key("val_steps"), self.key("val_pending")
        assert prompts and all(p.validation_step == step for p in prompts)

        def enqueue(pipe: Pipeline) -> bool:
            if pipe.hexists(steps, step):
                return False
            pipe.multi()
            pipe.hset(steps, step, len(prompts))
            pipe.sadd(pending, step)
            for p in prompts:
                pipe.xadd(self.key("val_prompts"), {"prompt": to_json(p)})
                pipe.hset(self.key("val_ledger", step), p.index, "outstanding")
            return True

        return self.redis.transaction(enqueue, steps, value_from_callable=True)

    def claim_validation(self, consumer: str, count: int) -> list[tuple[str, Prompt]]:
        """Take up to `count` validation prompts for rollout replica `consumer` (no waiting);
        they stay pending for it until :meth:`ack_validation` or :meth:`requeue_validation`."""
        reply = self.redis.xreadgroup(
            ROLLOUT_GROUP, consumer, {self.key("val_prompts"): ">"}, count=count
        )
        return [
            (msg_id, from_json(Prompt, f["prompt"]))
            for _, entries in reply
            for msg_id, f in entries
        ]

    def ack_validation(self, msg_ids: list[str]) -> None:
        """A rollout replica is done with these validation prompts (their groups are pushed)."""
        if msg_ids:
            with self.redis.pipeline() as pipe:
                pipe.xack(self.key("val_prompts"), ROLLOUT_GROUP, *msg_ids)
                pipe.xdel(self.key("val_prompts"), *msg_ids)
                pipe.execute()

    def requeue_validation(self, consumer: str) -> int:
        """Put the unanswered validation prompts `consumer` holds back on the stream (e.g. it
        died), each as a new entry, in one transaction with the acknowledgement of the old ones;
        returns how many."""
        stream, requeued = self.key("val_prompts"), 0
        while pending := self.redis.xpending_range(stream, ROLLOUT_GROUP, "-", "+", 1000, consumer):
            msg_ids = [p["message_id"] for p in pending]
            with self.redis.pipeline(transaction=False) as pipe:
                for msg_id in msg_ids:
                    pipe.xrange(stream, msg_id, msg_id)
                prompts = [from_json(Prompt, e[0][1]["prompt"]) for e in pipe.execute() if e]
            requeued += self._requeue_held_validation(prompts, msg_ids)
        if requeued:
            log.info("requeued %d validation prompts held by %s", requeued, consumer)
        return requeued

    def _requeue_held_validation(self, prompts: list[Prompt], msg_ids: list[str]) -> int:
        """Requeue the unanswered ones of `prompts` and acknowledge their entries `msg_ids`, in
        one transaction (watching the ledgers it reads: the controller records answers from
        another process); returns how many were requeued."""
        stream = self.key("val_prompts")

        def requeue(pipe: Pipeline) -> int:
            states = [
                pipe.hget(self.key("val_ledger", p.validation_step), p.index) for p in prompts
            ]
            pipe.multi()
            held = [
                p for p, s in zip(prompts, states, strict=True) if s in ("outstanding", "requeued")
            ]
            for p in held:
                pipe.xadd(stream, {"prompt": to_json(p)})
                pipe.hset(self.key("val_ledger", p.validation_step), p.index, "requeued")
            pipe.xack(stream, ROLLOUT_GROUP, *msg_ids)
            pipe.xdel(stream, *msg_ids)
            return len(held)

        ledgers = sorted({self.key("val_ledger", p.validation_step) for p in prompts})
        return self.redis.transaction(requeue, *ledgers, value_from_callable=True)

    def record_answers(self, pushed: list[PushedGroup]) -> int:
        """Keep the first answer to each validation prompt among `pushed` (all validation
        groups) and drop those answered before; returns how many were kept. One transaction,
        which also acknowledges the stream entries; the validation ledgers are watched (a
        replica's prompts may be requeued meanwhile)."""
        if not pushed:
            return 0
        by_step: dict[int, list[PushedGroup]] = {}
        for g in pushed:
            step = g.header.prompt.validation_step
            assert step is not None, "not a validation group"
            by_step.setdefault(step, []).append(g)

        def decide(pipe: Pipeline) -> int:
            kept: dict[int, dict[int, str]] = {}  # step -> index -> result
            for step, groups in by_step.items():
                indices = [g.header.prompt.index for g in groups]
                states = pipe.hmget(self.key("val_ledger", step), indices)
                for g, state in zip(groups, states, strict=True):
                    answers = kept.setdefault(step, {})
                    if (
                        state in ("outstanding", "requeued")
                        and g.header.prompt.index not in answers
                    ):
                        answers[g.header.prompt.index] = json.dumps(_result(g.header))
            pipe.multi()
            for step, answers in kept.items():
                if answers:
                    pipe.hset(self.key("val_ledger", step), mapping=dict.fromkeys(answers, "done"))
                    pipe.hset(self.key("val_results", step), mapping=answers)  # type: ignore[arg-type]
            self._ack_groups(pipe, pushed)
            return sum(len(answers) for answers in kept.values())

        ledgers = [self.key("val_ledger", step) for step in by_step]
        return self.redis.transaction(decide, *ledgers, value_from_callable=True)

    def pending_validations(self) -> list[int]:
        """Steps whose validation was handed out and is not recorded yet, in order."""
        return sorted(int(s) for s in self.redis.smembers(self.key("val_pending")))

    def validation_started(self, step: int) -> bool:
        """Whether the validation of `step` was handed out (it may be recorded already)."""
        return bool(self.redis.hexists(self.key("val_steps"), step))

    def validation_results(self, step: int) -> list[dict[str, Any]] | None:
        """The answers of `step`'s validation prompts once every one is in (each: `rewards`,
        `lengths` and policy `versions` of its completions; empty for a prompt that could not be
        generated), else None."""
        total = self.redis.hget(self.key("val_steps"), step)
        results = self.redis.hvals(self.key("val_results", step))
        if total is None or len(results) < int(total):
            return None
        return [json.loads(r) for r in results]

    def finish_validation(self, step: int, record: dict[str, Any]) -> bool:
        """Record `step`'s validation: append `record` to the step records (see
        `Ledger.step_records`) and take the step off the pending ones, in one transaction;
        False if it was recorded before."""
        pending = self.key("val_pending")

        def finish(pipe: Pipeline) -> bool:
            if not pipe.sismember(pending, step):
                return False
            pipe.multi()
            pipe.srem(pending, step)
            pipe.rpush(self.key("metrics"), json.dumps(record))
            return True

        return self.redis.transaction(finish, pending, value_from_callable=True)


def _result(header: GroupHeader) -> dict[str, list[Any]]:
    """What a validation answer keeps: its completions' rewards, lengths and policy versions,
    and a world model's distance to the data (none when the rollout could not generate it, or
    its rewards were lost)."""
    if header.failed:
        return {"rewards": [], "lengths": [], "versions": []}
    out = {"rewards": header.rewards, "lengths": header.lengths, "versions": header.versions}
    if header.distance is not None:  # (a world model's)
        out["distances"] = [header.distance]
    return out
