"""The controller: durable job state in Redis, and the HTTP control plane over it.

- :mod:`~nebula_rl.controller.redis_server` starts a private Redis for a job.
- :mod:`~nebula_rl.controller.state` holds the prompt ledger, the completion buffer, the policy
  version and the replica registry, all in Redis.
- :mod:`~nebula_rl.controller.app` serves register / heartbeat / unregister / meta / status.
"""

from nebula_rl.controller.app import HttpServer, create_app, serve
from nebula_rl.controller.redis_server import RedisServer, connect, start_redis
from nebula_rl.controller.state import JobState

__all__ = [
    "HttpServer",
    "JobState",
    "RedisServer",
    "connect",
    "create_app",
    "serve",
    "start_redis",
]
