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

from nebula_rl.controller.state._base import CONTROLLER_GROUP, ROLLOUT_GROUP, StateBase
from nebula_rl.protocol import Prompt, RolloutGroup, from_json, to_json

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
            states = [self._val_state(p) for p in prompts]
            with self.redis.pipeline() as pipe:  # MULTI/EXEC
                for p, state in zip(prompts, states, strict=True):
                    if state in ("outstanding", "requeued"):
                        pipe.xadd(stream, {"prompt": to_json(p)})
                        pipe.hset(self.key("val_ledger", p.validation_step), p.index, "requeued")
                        requeued += 1
                pipe.xack(stream, ROLLOUT_GROUP, *msg_ids)
                pipe.xdel(stream, *msg_ids)
                pipe.execute()
        if requeued:
            log.info("requeued %d validation prompts held by %s", requeued, consumer)
        return requeued

    def _val_state(self, prompt: Prompt) -> str | None:
        return self.redis.hget(self.key("val_ledger", prompt.validation_step), prompt.index)

    def record_validation(self, group: RolloutGroup, *, msg_id: str | None = None) -> bool:
        """Keep the answer `group` to a validation prompt unless the prompt was answered before;
        True if kept. `msg_id` (from `poll_groups`) is acknowledged in the same transaction."""
        p = group.prompt
        assert p.validation_step is not None, "not a validation group"
        ledger = self.key("val_ledger", p.validation_step)
        failed = "error" in group.extra
        result = {
            "rewards": [] if failed else [c.reward for c in group.completions],
            "lengths": [] if failed else [len(c.token_ids) for c in group.completions],
            "versions": [] if failed else [c.policy_version for c in group.completions],
        }

        def decide(pipe: Pipeline) -> bool:
            new = pipe.hget(ledger, p.index) in ("outstanding", "requeued")
            pipe.multi()
            if new:
                pipe.hset(ledger, p.index, "done")
                pipe.hset(self.key("val_results", p.validation_step), p.index, json.dumps(result))
            if msg_id is not None:
                pipe.xack(self.key("groups"), CONTROLLER_GROUP, msg_id)
                pipe.xdel(self.key("groups"), msg_id)
            return new

        return self.redis.transaction(decide, ledger, value_from_callable=True)

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
