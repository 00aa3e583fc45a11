"""The controller's HTTP API, served from a process of its own.

The scheduler loop (judging groups, batching, scheduling steps) is busy Python; sharing one
interpreter lock with it, the API answered a heartbeat in ~10x the bare HTTP round trip under
load (BENCHMARKS.md, "Controller scale"). The API needs nothing of the loop: every endpoint reads
and writes the job's state in Redis (the dashboard also reads `metrics.jsonl`). So
`nebula-rl controller` runs the loop in its main process and the API in a child that it starts
(spawn), watches and stops:

- the child binds `host:port` and reports the bound port, or why it could not bind, before the
  loop starts; one that cannot start is an error;
- an API process that dies while serving is logged and started again on the same port, from the
  loop (:meth:`ApiProcess.check`); replicas retry their heartbeats meanwhile, as they do while a
  whole controller restarts;
- the child holds the only read end of a pipe that only the parent writes to: the parent's death,
  even by SIGKILL, reads as end-of-file there and the child exits at once, so no orphan keeps the
  port; a normal stop is a message on the same pipe.

Simplification: one API process (uvicorn, one event loop, a thread pool for the handlers). It
holds no state, so several could serve one port, but one keeps up with the heartbeats of 1,024
replicas on two cores (`bench/controller_scale.py`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["ApiProcess", "ApiSpec"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiSpec:
    """Everything the API process needs, sent to it when it starts (see
    :func:`~nebula_rl.controller.app.create_app` for the fields it passes on)."""

    redis_url: str
    """The job's Redis (with its password)."""
    job: str
    """The job's name: its keys' prefix in Redis."""
    token: str
    """The bearer token every endpoint but `/health` asks for."""
    host: str
    """Interface to serve on."""
    port: int
    """Port to serve on (0: any free one; a restarted API process keeps the first one)."""
    config_json: dict[str, Any]
    """The job's config, as `/api/meta` returns it."""
    meta_extra: dict[str, Any]
    """More fields of `/api/meta` (the Redis URL, the run folder, the number of steps...)."""
    metrics_path: Path | None
    """The scheduler's `metrics.jsonl`, which the dashboard plots."""
    heartbeat_timeout: float
    """Seconds of silence after which the dashboard calls a replica lost."""
    log_level: int = logging.INFO
    """The API process's logging level."""


class ApiProcess:
    """The API process of :class:`ApiSpec` `spec`: :meth:`start` it (or use `with`), call
    :meth:`check` from the loop, :meth:`stop` it."""

    def __init__(self, spec: ApiSpec, *, start_timeout_s: float = 60.0) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.port = spec.port
        """The bound port, once started."""
        self.restarts = 0
        """API processes started again after one died."""
        self._ctx = mp.get_context("spawn")
        self._process: Any = None
        self._conn: Connection | None = None

    @property
    def url(self) -> str:
        """`http://host:port`."""
        return f"http://{self.spec.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The API process's id (None before it started)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the API process; returns once it listens, raises `RuntimeError` if it cannot."""
        assert self._process is None, "already started"
        spec = replace(self.spec, port=self.port)
        conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_serve, args=(spec, child_conn), name="controller-api", daemon=True
        )
        process.start()
        child_conn.close()  # the child's end lives in the child only: our death is its EOF
        self._process, self._conn = process, conn
        try:
            if not conn.poll(self.start_timeout_s):
                raise RuntimeError(
                    f"the controller's API process did not start within "
                    f"{self.start_timeout_s:.0f} s"
                )
            status, detail = conn.recv()
        except (EOFError, RuntimeError) as err:
            self.stop()
            if isinstance(err, RuntimeError):
                raise
            raise RuntimeError(
                f"the controller's API process exited while starting (code {process.exitcode})"
            ) from None
        if status != "listening":
            self.stop()
            raise RuntimeError(
                f"the controller's API could not serve on {spec.host}:{spec.port}: {detail}"
            )
        self.port = detail

    def check(self) -> None:
        """Start the API process again if it died (from the loop: the API must not stay down)."""
        if self._process is None or self._process.is_alive():
            return
        code = self._process.exitcode
        self._close()
        self.restarts += 1
        log.error(
            "the controller's API process died (exit code %s): starting it again on port %d",
            code,
            self.port,
        )
        self.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the API process to finish its requests and exit; kill it after `timeout_s`."""
        if self._process is None:
            return
        assert self._conn is not None
        with contextlib.suppress(OSError):  # (it may be gone already)
            self._conn.send("stop")
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.warning("the controller's API process did not stop: killing it")
            self._process.kill()
            self._process.join()
        self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            self._process.close()
        self._process, self._conn = None, None

    def __enter__(self) -> ApiProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _serve(spec: ApiSpec, conn: Connection) -> None:
    """The API process: serve until the parent says stop or dies."""
    import redis

    from nebula_rl.controller.app import create_app, serve
    from nebula_rl.controller.redis_server import connect
    from nebula_rl.controller.state import JobState

    # Ctrl-C reaches the whole process group; the parent stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(levelname)s %(name)s (api): %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        state = JobState(connect(spec.redis_url), spec.job)
        app = create_app(
            state=state,
            config_json=spec.config_json,
            token=spec.token,
            meta_extra=spec.meta_extra,
            metrics_path=spec.metrics_path,
            heartbeat_timeout=spec.heartbeat_timeout,
        )
        server = serve(app, host=spec.host, port=spec.port)
    except (OSError, RuntimeError, redis.RedisError) as err:
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    conn.send(("listening", server.port))
    try:
        conn.recv()  # "stop"
    except EOFError:  # the controller died
        log.warning("the controller is gone: its API process stops")
    server.stop()
