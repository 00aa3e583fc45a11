"""The whole job state as Redis serialises it, for checkpoints."""

from __future__ import annotations

import base64

import redis

from nebula_rl.controller.state._base import StateBase

__all__ = ["Snapshots"]


class Snapshots(StateBase):
    """DUMP every key of the job atomically; RESTORE them all in one transaction."""

    def _binary(self) -> redis.Redis:
        """A client on the same server that returns bytes (DUMP payloads are not text)."""
        pool = self.redis.connection_pool
        kwargs = {**pool.connection_kwargs, "decode_responses": False}
        return redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        )

    def snapshot(self) -> dict[str, str]:
        """Every key of this job as Redis serialises it (DUMP, base64), by its name without the
        job prefix, taken atomically (one script): streams keep their consumer groups and
        pending entries. A checkpoint stores it so that :meth:`restore` puts the job back
        exactly where it was (under this or another job name)."""
        script = (
            "local out = {} "
            "for _, k in ipairs(redis.call('KEYS', ARGV[1])) do "
            "out[#out + 1] = k; out[#out + 1] = redis.call('DUMP', k) end "
            "return out"
        )
        client = self._binary()
        try:
            flat = client.eval(script, 0, self.prefix.encode() + b"*")
        finally:
            client.close()
        return {
            flat[i].decode().removeprefix(self.prefix): base64.b64encode(flat[i + 1]).decode()
            for i in range(0, len(flat), 2)
        }

    def _restore_keys(self, snapshot: dict[str, str]) -> None:
        """Replace every key of this job by those of `snapshot`, in one transaction."""
        client = self._binary()
        try:
            with client.pipeline(transaction=True) as pipe:
                for k in client.keys(self.prefix.encode() + b"*"):
                    pipe.delete(k)
                for k, payload in snapshot.items():
                    pipe.restore(self.prefix + k, 0, base64.b64decode(payload), replace=True)
                pipe.execute()
        finally:
            client.close()
