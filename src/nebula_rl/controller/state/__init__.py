"""The job's durable state in Redis: prompt ledger, completion buffer, versions, replica registry.

Everything a restarted controller needs lives here, under keys prefixed `nebula:<job>:`; the
controller process itself keeps nothing it cannot rebuild from Redis.

Life of a prompt in an epoch (the ledger, `ledger:<epoch>`, maps dataset index -> state)::

    enqueue_prompts        -> outstanding   (XADD to the `prompts` stream)
    claim_prompts          -> a rollout replica holds it (pending in consumer group `rollout`)
    push_group + ack       -> its RolloutGroup waits in the `groups` stream (with its header)
    judge_groups           -> completed     (in the buffer)     or, if too stale, requeued,
                           or filtered      (dynamic sampling dropped its all-equal group)
    requeue_pending        -> requeued      (a dead replica's prompts go back to the stream)
    next_batch/mark_trained-> trained

With on-policy distillation (`[distillation]`) a training group waits in `teacher_groups` until a
teacher replica scored it, and only then enters `groups` (see `teacher`).

Exactly once: a prompt may be generated more than once (a replica that was declared dead but was
only slow pushes its group anyway), but only the first group of each `prompt_id` is accepted
(`accepted:<epoch>` set), so it is trained once. Nothing is lost: a prompt leaves the streams only
when its group is accepted or it is put back as a new stream entry, in one transaction.

The controller judges a group by its header (:class:`~nebula_rl.protocol.GroupHeader`: prompt,
versions, rewards, lengths), pushed beside it, and keeps the group's JSON as it came: the
buffer holds what the rollout pushed, and only the policy decodes it. A poll's groups are judged
in one transaction.

Validation prompts live beside the ledger, never in it (`validation`): their own stream and
per-step ledger, answered exactly once by the same means, recorded as `val/*` records of the step
they validate.

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

The state is split by concern: `ledger` (prompts, buffer, steps), `validation` (validation
prompts and answers), `registry` (replicas and heartbeats), `commands` (commands and results),
`groups` (elastic group generations), `snapshot` (checkpoints of the whole state), `teacher`
(groups waiting for a distillation teacher); `JobState`
combines them.
"""

from __future__ import annotations

import logging

from nebula_rl.controller.state._base import (
    CONTROLLER_GROUP,
    KINDS,
    POLICY_GROUP,
    ROLLOUT_GROUP,
    TEACHER_GROUP,
    PushedGroup,
)
from nebula_rl.controller.state.commands import Commands
from nebula_rl.controller.state.groups import Groups
from nebula_rl.controller.state.ledger import LEDGER_STATES, VERDICTS, Ledger
from nebula_rl.controller.state.registry import Registry
from nebula_rl.controller.state.snapshot import Snapshots
from nebula_rl.controller.state.teacher import TeacherQueue
from nebula_rl.controller.state.validation import Validation

__all__ = [
    "CONTROLLER_GROUP",
    "LEDGER_STATES",
    "POLICY_GROUP",
    "ROLLOUT_GROUP",
    "VERDICTS",
    "JobState",
    "PushedGroup",
]

log = logging.getLogger(__name__)


class JobState(Ledger, Validation, Registry, Commands, Groups, Snapshots, TeacherQueue):
    """All durable controller state of job `job`, kept in Redis (see the module docstring).

    `redis` must decode responses to `str` (see :func:`nebula_rl.controller.connect`). `clock`
    gives heartbeat times in seconds; tests pass a fake one.
    """

    def restore(self, snapshot: dict[str, str]) -> None:
        """Replace every key of this job by those of `snapshot`, in one transaction; then, since
        the replicas of that moment are gone, unregister them and requeue the prompts they held."""
        self._restore_keys(snapshot)
        self._groups.clear()
        self._create_stream_groups()  # (a snapshot of an older version may lack one)
        consumers = {
            consumer["name"]
            for stream in ("prompts", "val_prompts")
            for consumer in self.redis.xinfo_consumers(self.key(stream), ROLLOUT_GROUP)
        } | {
            consumer["name"]
            for consumer in self.redis.xinfo_consumers(self.key("teacher_groups"), TEACHER_GROUP)
        }
        for name in sorted(consumers):
            self.requeue_pending(name)
        for name in self.replicas():
            self.unregister_replica(name)
        # Their groups went with them (generation numbers keep growing: the counters stay).
        self.redis.delete(*(self.key(k, kind) for k in ("group", "regroup") for kind in KINDS))

    def requeue_pending(self, consumer: str) -> int:
        """Put the prompts `consumer` holds back on their streams, training prompts (see
        :meth:`Ledger.requeue_pending`) and validation prompts alike, and the groups it held
        for scoring as a teacher (:meth:`TeacherQueue.requeue_teacher`); returns how many."""
        return (
            Ledger.requeue_pending(self, consumer)
            + self.requeue_validation(consumer)
            + self.requeue_teacher(consumer)
        )

    def reap_dead_replicas(self, timeout: float) -> list[str]:
        """Unregister replicas silent for `timeout` seconds and requeue their prompts."""
        dead = self.dead_replicas(timeout)
        for name in dead:
            log.warning("replica %s missed heartbeats for %.0f s: removing it", name, timeout)
            self.requeue_pending(name)
            self.unregister_replica(name)
        return dead
