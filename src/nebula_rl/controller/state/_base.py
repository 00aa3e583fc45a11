"""What every part of the job's Redis state shares: the client, the job's key prefix, the
names of the streams' consumer groups, a pushed group as the controller reads it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.client import Pipeline
from redis.exceptions import ResponseError

from nebula_rl.protocol import GroupHeader, RolloutGroup, to_json

__all__ = [
    "CONTROLLER_GROUP",
    "KINDS",
    "POLICY_GROUP",
    "ROLLOUT_GROUP",
    "TEACHER_GROUP",
    "PushedGroup",
    "StateBase",
]

ROLLOUT_GROUP = "rollout"
"""Consumer group of rollout replicas on the `prompts` stream."""
CONTROLLER_GROUP = "controller"
"""Consumer group of the controller on the `groups` and `results` streams."""
POLICY_GROUP = "policy"
"""Consumer group of a policy replica on its `commands:<replica>` stream."""
TEACHER_GROUP = "teacher"
"""Consumer group of teacher replicas on the `teacher_groups` stream (on-policy distillation)."""
KINDS = ("policy", "weights")
"""The elastic groups: the policy replicas' data-parallel group, the weight group."""


@dataclass(frozen=True, slots=True)
class PushedGroup:
    """A group as the `groups` stream holds it: its header decoded, its body (the
    :class:`~nebula_rl.protocol.RolloutGroup` as JSON) kept as it came, for the buffer."""

    msg_id: str | None
    """Its entry in the `groups` stream (None: not from the stream, e.g. in a test)."""
    header: GroupHeader
    """What judging needs."""
    header_json: str
    """The header as pushed (the buffer keeps it beside the body)."""
    body: str
    """The whole group as pushed; only the policy decodes it."""

    @classmethod
    def of(cls, group: RolloutGroup, msg_id: str | None = None) -> PushedGroup:
        """`group` as :meth:`~nebula_rl.controller.state.ledger.Ledger.push_group` sends it."""
        header = GroupHeader.of(group)
        return cls(msg_id, header, to_json(header), to_json(group))


_JOB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class StateBase:
    """The Redis client and key naming of one job's state.

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
        self._create_stream_groups()

    def _create_stream_groups(self) -> None:
        """The streams every job has, with their consumer groups (kept when they exist)."""
        for stream, group in (
            (self.key("prompts"), ROLLOUT_GROUP),
            (self.key("val_prompts"), ROLLOUT_GROUP),
            (self.key("groups"), CONTROLLER_GROUP),
            (self.key("results"), CONTROLLER_GROUP),
            (self.key("teacher_groups"), TEACHER_GROUP),
        ):
            try:
                self.redis.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    def key(self, *parts: object) -> str:
        """`nebula:<job>:<part>:<part>...`."""
        return self.prefix + ":".join(str(p) for p in parts)

    def _ack_groups(self, pipe: Pipeline, pushed: list[PushedGroup]) -> None:
        """Acknowledge and delete the stream entries of `pushed` (in the caller's transaction,
        with what was decided about them)."""
        msg_ids = [g.msg_id for g in pushed if g.msg_id is not None]
        if msg_ids:
            pipe.xack(self.key("groups"), CONTROLLER_GROUP, *msg_ids)
            pipe.xdel(self.key("groups"), *msg_ids)
