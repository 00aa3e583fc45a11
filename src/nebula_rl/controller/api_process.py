"""The controller's HTTP API, served from a process of its own.

The scheduler loop (judging groups, batching, scheduling steps) is busy Python; sharing one
interpreter lock with it, the API answered a heartbeat in ~10x the bare HTTP round trip under
load (BENCHMARKS.md, "Controller scale"). The API needs nothing of the loop: every endpoint reads
and writes the job's state in Redis (the dashboard also reads `metrics.jsonl`). So
`nebula-rl controller` runs the loop in its main process and the API in a child that it starts
(spawn), watches and stops:

- the child binds `host:port` and reports the bound port, or why it could not bind, before the
  loop starts; one that cannot start is an error;
- an API process that dies while serving is logged and started again on the same port by a
  watcher thread of the controller (:class:`ApiProcess` starts it); replicas retry their
  heartbeats meanwhile, as they do while a whole controller restarts;
- the child holds the only read end of a pipe that only the parent writes to: the parent's death,
  even by SIGKILL, reads as end-of-file there and the child exits at once, so no orphan keeps the
  port; a normal stop is a message on the same pipe.

Priority. On a host whose cores are all busy, a heartbeat waits for a core behind the scheduler
loop's judging: on 2 cores it took ~20x the bare HTTP round trip at p99. Heartbeats are the
latency-bound work (a late one makes a live replica look dead); judging is throughput work that
a short wait does not hurt. So the loop's thread lowers its own priority
(:func:`lower_thread_priority`, `controller.scheduler_niceness`) and the API process keeps the
normal one. Linux keeps a nice value per thread and a process inherits the one of the thread
that starts it, which is why the restarts come from the watcher thread, started before the loop
lowers its priority, and never from the loop.

Simplification: one API process (uvicorn, one event loop, a thread pool for the handlers). It
holds no state, so several could serve one port; one serves the heartbeats of 1,024 replicas
(512 a second) while it gets a core (`bench/controller_scale.py`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["ApiProcess", "ApiSpec", "lower_thread_priority"]

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
    """The API process of :class:`ApiSpec` `spec`: :meth:`start` it (or use `with`) and
    :meth:`stop` it; in between, a watcher thread starts it again whenever it dies."""

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
        self._lock = threading.Lock()  # (the watcher's restarts against stop)
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        """`http://host:port`."""
        return f"http://{self.spec.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The API process's id (None before it started)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the API process and its watcher; returns once it listens, raises
        `RuntimeError` if it cannot."""
        assert self._watcher is None, "already started"
        self._spawn()
        self._watcher = threading.Thread(
            target=self._watch, name="controller-api-watch", daemon=True
        )
        self._watcher.start()

    def _spawn(self) -> None:
        """Start an API process on `self.port`; raises `RuntimeError` if it cannot serve."""
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
            self._end()
            if isinstance(err, RuntimeError):
                raise
            raise RuntimeError(
                f"the controller's API process exited while starting (code {process.exitcode})"
            ) from None
        if status != "listening":
            self._end()
            raise RuntimeError(
                f"the controller's API could not serve on {spec.host}:{spec.port}: {detail}"
            )
        self.port = detail

    def _watch(self) -> None:
        """Watcher thread: start the API process again each time it dies, until :meth:`stop`
        (a restart that fails is tried again a second later: the API must not stay down)."""
        while not self._stopping.is_set():
            process = self._process
            if process is not None:
                wait([process.sentinel])
            with self._lock:
                if self._stopping.is_set():
                    return
                if self._process is not None:
                    self._process.join()  # (reaps it: dead, its sentinel said)
                    code = self._process.exitcode
                    self._close()
                    self.restarts += 1
                    log.error(
                        "the controller's API process died (exit code %s): starting it again "
                        "on port %d",
                        code,
                        self.port,
                    )
                try:
                    self._spawn()
                except RuntimeError as err:
                    log.error("%s; trying again in 1 s", err)
            if self._process is None:
                self._stopping.wait(1.0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the watcher, then ask the API process to finish its requests and exit; kill it
        after `timeout_s`."""
        with self._lock:
            self._stopping.set()
            self._end(timeout_s)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout_s)

    def _end(self, timeout_s: float = 10.0) -> None:
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


def lower_thread_priority(niceness: int) -> None:
    """Add `niceness` to the calling thread's nice value (Linux: a per-thread value; the
    process's other threads and the processes it already started keep theirs). Raising it needs
    no privilege; a platform without per-thread priorities is left as it is."""
    if niceness <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(19, current + niceness))


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
