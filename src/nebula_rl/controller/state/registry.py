"""The replica registry: who is registered, their heartbeats, who is ready.

A heartbeat is one round trip to Redis (a script: the check that the replica is registered, its
update and what it reads of the job), since the API answers every replica every few seconds
while the data plane keeps Redis busy. Who is ready is kept apart per role (`ready:<role>`, name
-> replica id), so the scheduler's membership checks read only that, not every replica's record.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from redis.asyncio import Redis as AsyncRedis
from redis.client import Pipeline

from nebula_rl.controller.state._base import StateBase

__all__ = ["ROLES", "Registry"]

ROLES = ("policy", "rollout", "teacher")
"""What a replica can be."""

_HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSET', KEYS[1], 'last_heartbeat', ARGV[1], 'policy_version', ARGV[2], 'stats', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[4])
return {redis.call('GET', KEYS[3]), redis.call('GET', KEYS[4]), redis.call('GET', KEYS[5])}
"""


def _job_position(reply: Any) -> dict[str, Any] | None:
    """The heartbeat script's reply as {policy_version, step, finished}; None: unregistered."""
    if reply is None:
        return None
    version, step, finished = reply
    return {"policy_version": int(version or 0), "step": int(step or 0), "finished": finished}


class Registry(StateBase):
    """Registered replicas (a hash each, plus a sorted set of last heartbeats)."""

    def register_replica(
        self,
        name: str,
        *,
        role: Literal["policy", "rollout", "teacher"],
        host: str,
        world_size: int,
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
            for r in ROLES:  # (ready again once it loaded its model)
                pipe.hdel(self.key("ready", r), name)
            pipe.execute()
        return replica_id

    def heartbeat(
        self, name: str, *, policy_version: int, stats: dict[str, float]
    ) -> dict[str, Any] | None:
        """Replica `name` is alive, holding weights `policy_version`; returns where the job
        stands ({policy_version, step, finished}), or None if `name` is not registered."""
        keys, args = self._heartbeat_call(name, policy_version, stats)
        return _job_position(self.redis.eval(_HEARTBEAT, len(keys), *keys, *args))

    async def heartbeat_async(
        self, client: AsyncRedis, name: str, *, policy_version: int, stats: dict[str, float]
    ) -> dict[str, Any] | None:
        """:meth:`heartbeat` through `client`, an asyncio client of the same Redis (what the
        HTTP API's event loop answers a heartbeat with, no thread in between)."""
        keys, args = self._heartbeat_call(name, policy_version, stats)
        return _job_position(await client.eval(_HEARTBEAT, len(keys), *keys, *args))

    def _heartbeat_call(
        self, name: str, policy_version: int, stats: dict[str, float]
    ) -> tuple[list[str], list[Any]]:
        keys = [self.key("replica", name), self.key("replicas")]
        keys += [self.key("policy_version"), self.key("step"), self.key("finished")]
        return keys, [self.clock(), policy_version, json.dumps(stats), name]

    def set_ready(self, name: str) -> bool:
        """Replica `name` has loaded its model and can join groups now; False if unregistered."""
        replica = self.key("replica", name)

        def mark(pipe: Pipeline) -> bool:
            role, replica_id = pipe.hmget(replica, ["role", "replica_id"])
            if role is None:
                return False
            pipe.multi()
            pipe.hset(replica, "ready", 1)
            pipe.hset(self.key("ready", role), name, replica_id)
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
            for r in ROLES:
                pipe.hdel(self.key("ready", r), name)
            deleted, *_ = pipe.execute()
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

    def is_registered(self, name: str) -> bool:
        """Whether replica `name` is registered (one key read, not :meth:`replicas`' all)."""
        return bool(self.redis.exists(self.key("replica", name)))

    def ready_replicas(self, role: str) -> dict[str, int]:
        """Registered replicas of `role` that loaded their model: name -> replica id."""
        return {n: int(i) for n, i in self.redis.hgetall(self.key("ready", role)).items()}

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
