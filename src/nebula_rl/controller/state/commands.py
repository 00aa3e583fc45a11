"""Commands to policy replicas (a stream per replica) and their results back."""

from __future__ import annotations

import json
from typing import Any

from redis.exceptions import ResponseError

from nebula_rl.controller.state._base import CONTROLLER_GROUP, POLICY_GROUP, StateBase

__all__ = ["Commands"]


class Commands(StateBase):
    """`commands:<replica>` streams (consumer group `policy`) and the `results` stream."""

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
