"""On-policy distillation's scoring queue: groups wait for a teacher before the controller
judges them.

With `distillation.enable` a rollout replica pushes each training group to the `teacher_groups`
stream (:meth:`push_for_teacher`) instead of `groups`. Teacher replicas read it in consumer
group `teacher` (:meth:`claim_for_teacher`), score the completions, and hand each scored group
in with :meth:`push_scored`, which adds it to `groups` and acknowledges its `teacher_groups`
entry in one transaction: from there it is judged and trained like any group, so a group
becomes trainable only once scored. The groups a teacher held when it died or left go back to
the stream for another (:meth:`requeue_teacher`); a group scored twice (a teacher declared dead
that was only slow) is judged a duplicate the second time.
"""

from __future__ import annotations

import logging

from redis.client import Pipeline

from nebula_rl.controller.state._base import TEACHER_GROUP, StateBase
from nebula_rl.protocol import GroupHeader, RolloutGroup, from_json, to_json

__all__ = ["TeacherQueue"]

log = logging.getLogger(__name__)


class TeacherQueue(StateBase):
    """The `teacher_groups` stream."""

    def push_for_teacher(self, group: RolloutGroup) -> str:
        """A rollout replica hands in a training group that a teacher must score first."""
        return self.redis.xadd(self.key("teacher_groups"), {"group": to_json(group)})

    def claim_for_teacher(
        self, consumer: str, count: int, block_ms: int = 0
    ) -> list[tuple[str, RolloutGroup]]:
        """Up to `count` groups for teacher `consumer` to score: (stream id, group). Those it
        claimed before and has not handed in (it restarted under its name) come first."""
        stream = self.key("teacher_groups")
        reply = self.redis.xreadgroup(TEACHER_GROUP, consumer, {stream: "0"}, count=count)
        if not reply or not reply[0][1]:
            reply = self.redis.xreadgroup(
                TEACHER_GROUP, consumer, {stream: ">"}, count=count, block=block_ms or None
            )
        return [
            (msg_id, from_json(RolloutGroup, fields["group"]))
            for _, entries in reply
            for msg_id, fields in entries
        ]

    def push_scored(self, msg_id: str, group: RolloutGroup) -> None:
        """Teacher's scores in: `group` goes to the `groups` stream and its `teacher_groups`
        entry `msg_id` is acknowledged, atomically."""
        with self.redis.pipeline() as pipe:
            pipe.xadd(
                self.key("groups"),
                {"header": to_json(GroupHeader.of(group)), "group": to_json(group)},
            )
            pipe.xack(self.key("teacher_groups"), TEACHER_GROUP, msg_id)
            pipe.xdel(self.key("teacher_groups"), msg_id)
            pipe.execute()

    def requeue_teacher(self, consumer: str) -> int:
        """Put the groups teacher `consumer` holds back on the stream as new entries (e.g. when
        it died), acknowledging the old ones in the same transaction; returns how many."""
        stream, requeued = self.key("teacher_groups"), 0
        while pending := self.redis.xpending_range(stream, TEACHER_GROUP, "-", "+", 1000, consumer):
            msg_ids = [p["message_id"] for p in pending]

            def requeue(pipe: Pipeline, msg_ids: list[str] = msg_ids) -> int:
                bodies = [pipe.xrange(stream, i, i) for i in msg_ids]
                pipe.multi()
                for entry in bodies:
                    if entry:
                        pipe.xadd(stream, {"group": entry[0][1]["group"]})
                pipe.xack(stream, TEACHER_GROUP, *msg_ids)
                pipe.xdel(stream, *msg_ids)
                return sum(1 for entry in bodies if entry)

            requeued += self.redis.transaction(requeue, stream, value_from_callable=True)
        if requeued:
            log.info("requeued %d groups held by teacher %s", requeued, consumer)
        return requeued

    def teacher_backlog(self) -> int:
        """Groups waiting for, or held by, a teacher."""
        return self.redis.xlen(self.key("teacher_groups"))
