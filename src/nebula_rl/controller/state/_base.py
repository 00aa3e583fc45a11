"""What every part of the job's Redis state shares: the client, the job's key prefix, the
names of the streams' consumer groups."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import redis
from redis.exceptions import ResponseError

__all__ = ["CONTROLLER_GROUP", "KINDS", "POLICY_GROUP", "ROLLOUT_GROUP", "StateBase"]

ROLLOUT_GROUP = "rollout"
"""Consumer group of rollout replicas on the `prompts` stream."""
CONTROLLER_GROUP = "controller"
"""Consumer group of the controller on the `groups` and `results` streams."""
POLICY_GROUP = "policy"
"""Consumer group of a policy replica on its `commands:<replica>` stream."""
KINDS = ("policy", "weights")
"""The elastic groups: the policy replicas' data-parallel group, the weight group."""

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
        ):
            try:
                self.redis.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    def key(self, *parts: object) -> str:
        """`nebula:<job>:<part>:<part>...`."""
        return self.prefix + ":".join(str(p) for p in parts)
