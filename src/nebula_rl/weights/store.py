"""A torch.distributed key-value store in the job's Redis, where replicas' groups meet.

Process groups between separately started replicas need a store to meet in. A TCPStore would
be one more listening port, without authentication: anyone who reaches it could join a group or
stall its rendezvous. The job already has a Redis server that every replica reaches with the
job's password (handed out only by the authenticated controller API), so the groups meet there
instead, and the controller process itself needs no torch. `RedisStore` implements the c10d
`Store` interface (gloo and NCCL rendezvous use `set`, `get`, `wait`, `add`, `check`) over
Redis strings; keys expire a day after their last write, so finished groups leave nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import redis
from torch.distributed import DistStoreError, Store

__all__ = ["RedisStore"]

_POLL_S = 0.005
_TTL_S = 24 * 3600
_COMPARE_SET = """
local current = redis.call('GET', KEYS[1])
if (current == false and ARGV[1] == '') or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return ARGV[2]
end
if current == false then return ARGV[1] end
return current
"""


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RedisStore(Store):
    """c10d `Store` over a Redis server; every key is prefixed with `prefix`.

    Keep a reference to the object for as long as a group built on it lives: the c10d side holds
    only the C++ half, and the Python methods disappear with the Python object.
    """

    def __init__(
        self, client: redis.Redis, *, prefix: str, timeout: timedelta = timedelta(minutes=5)
    ) -> None:
        super().__init__()
        kwargs = {**client.connection_pool.connection_kwargs, "decode_responses": False}
        pool = redis.ConnectionPool(
            connection_class=client.connection_pool.connection_class, **kwargs
        )
        self._redis = redis.Redis(connection_pool=pool)
        self._prefix = prefix
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self._prefix + key

    # -- the c10d Store interface ---------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._redis.set(self._key(key), _bytes(value), ex=_TTL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._redis.get(self._key(key))
        assert value is not None
        return bytes(value)

    def add(self, key: str, amount: int) -> int:
        with self._redis.pipeline() as pipe:
            pipe.incrby(self._key(key), amount)
            pipe.expire(self._key(key), _TTL_S)
            value, _ = pipe.execute()
        return int(value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        result = self._redis.eval(
            _COMPARE_SET, 1, self._key(key), _bytes(expected), _bytes(desired), _TTL_S
        )
        return bytes(result)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise DistStoreError(
                    f"RedisStore: keys {list(keys)} under {self._prefix!r} did not appear within "
                    f"{limit:g}s"
                )
            time.sleep(_POLL_S)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(keys) and self._redis.exists(*(self._key(k) for k in keys)) == len(keys)

    def delete_key(self, key: str) -> bool:
        return bool(self._redis.delete(self._key(key)))

    def num_keys(self) -> int:
        return sum(1 for _ in self._redis.scan_iter(match=self._prefix + "*"))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def clone(self) -> RedisStore:
        twin = RedisStore(self._redis, prefix=self._prefix, timeout=self._timeout)
        _CLONES.append(twin)  # (the c10d side keeps only the C++ half of a clone)
        return twin

    def has_extended_api(self) -> bool:
        return True

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self.wait(keys)
        return [bytes(v) for v in self._redis.mget([self._key(k) for k in keys])]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        with self._redis.pipeline() as pipe:
            for key, value in zip(keys, values, strict=True):
                pipe.set(self._key(key), _bytes(value), ex=_TTL_S)
            pipe.execute()

    def append(self, key: str, value: Any) -> None:
        with self._redis.pipeline() as pipe:
            pipe.append(self._key(key), _bytes(value))
            pipe.expire(self._key(key), _TTL_S)
            pipe.execute()

    def list_keys(self) -> list[str]:
        size = len(self._prefix)
        return [k.decode()[size:] for k in self._redis.scan_iter(match=self._prefix + "*")]


_CLONES: list[RedisStore] = []
