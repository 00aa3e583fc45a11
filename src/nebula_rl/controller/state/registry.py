"""The replica registry: who is registered, their heartbeats, who is ready."""

from __future__ import annotations

import json
from typing import Any, Literal

from redis.client import Pipeline

from nebula_rl.controller.state._base import StateBase

__all__ = ["Registry"]


class Registry(StateBase):
    """Registered replicas (a hash each, plus a sorted set of last heartbeats)."""

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

    def dead_replicas(self, timeout: float) -> list[str]:
        """Replicas whose last heartbeat is more than `timeout` seconds old."""
        return self.redis.zrangebyscore(self.key("replicas"), "-inf", f"({self.clock() - timeout}")


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
