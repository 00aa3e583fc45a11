"""The controller's HTTP API, served from processes of its own.

The scheduler loop (judging groups, batching, scheduling steps) is busy Python; sharing one
interpreter lock with it, the API answered a heartbeat in ~10x the bare HTTP round trip under
load (BENCHMARKS.md, "Controller scale"). The API needs nothing of the loop: every endpoint reads
and writes the job's state in Redis (the dashboard also reads `metrics.jsonl`). So
`nebula-rl controller` runs the loop in its main process and the API in children that it starts
(spawn), watches and stops:

- the controller binds `host:port` itself and hands the listening socket to each API process
  (`controller.api_processes` of them, uvicorn each; the kernel gives each new connection to one
  of them); a port it cannot bind, or an API process that cannot start, is an error before the
  loop starts;
- an API process that dies while serving is logged and started again on the same socket by a
  watcher thread of the controller; the port stays bound meanwhile (the controller holds it), so
  new connections wait in its queue, and replicas retry the heartbeats that failed;
- each child holds the only read end of a pipe that only the parent writes to: the parent's
  death, even by SIGKILL, reads as end-of-file there and the child exits at once, so no orphan
  keeps the port; a normal stop is a message on the same pipe.

Priority. On a host whose cores are all busy, a heartbeat can wait for a core behind the
scheduler loop's judging. With `controller.scheduler_niceness` the loop's thread lowers its own
priority (:func:`lower_thread_priority`) and the API processes keep the normal one. Linux keeps a
nice value per thread and a process inherits the one of the thread that starts it, which is why
the restarts come from the watcher thread, started before the loop lowers its priority, and
never from the loop. (On 2 cores it changed nothing measurable, hence off by default.)

Several API processes hold no state between them: every request reads and writes Redis, so any
of them answers any request (the dashboard's session cookie is derived from the job's token).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import TracebackType
from typing import Any

from nebula_rl.utils.net import bind_socket

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
    """Port to serve on (0: any free one)."""
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


@dataclass
class _Child:
    """One API process and the parent's end of its pipe."""

    process: Any
    conn: Connection


class ApiProcess:
    """The API processes of :class:`ApiSpec` `spec` (`processes` of them on one listening
    socket): :meth:`start` them (or use `with`) and :meth:`stop` them; in between, a watcher
    thread starts each again whenever it dies."""

    def __init__(self, spec: ApiSpec, *, processes: int = 1, start_timeout_s: float = 60.0) -> None:
        if processes < 1:
            raise ValueError(f"an API needs at least one process, not {processes}")
        self.spec = spec
        self.processes = processes
        self.start_timeout_s = start_timeout_s
        self.port = spec.port
        """The bound port, once started."""
        self.restarts = 0
        """API processes started again after one died."""
        self._ctx = mp.get_context("spawn")
        self._sock: socket.socket | None = None
        self._children: list[_Child | None] = [None] * processes
        self._lock = threading.Lock()  # (the watcher's restarts against stop)
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        """`http://host:port`."""
        return f"http://{self.spec.host}:{self.port}"

    @property
    def pids(self) -> list[int]:
        """The running API processes' ids."""
        return [c.process.pid for c in self._children if c is not None]

    def start(self) -> None:
        """Bind the port, start the API processes and their watcher; returns once all listen,
        raises `RuntimeError` if they cannot."""
        assert self._watcher is None, "already started"
        self._sock = _listen(self.spec.host, self.spec.port)
        self.port = self._sock.getsockname()[1]
        try:  # (all started at once: each one's imports take a second or two)
            for i in range(self.processes):
                self._launch(i)
            for i in range(self.processes):
                self._await_listening(i)
        except RuntimeError:
            self.stop()
            raise
        self._watcher = threading.Thread(
            target=self._watch, name="controller-api-watch", daemon=True
        )
        self._watcher.start()

    def _spawn(self, i: int) -> None:
        """Start API process `i` on the listening socket; `RuntimeError` if it cannot serve."""
        self._launch(i)
        self._await_listening(i)

    def _launch(self, i: int) -> None:
        """Start API process `i` on the listening socket."""
        conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_serve, args=(self.spec, self._sock, child_conn), name=f"controller-api-{i}",
            daemon=True,
        )  # fmt: skip
        process.start()
        child_conn.close()  # the child's end lives in the child only: our death is its EOF
        self._children[i] = _Child(process, conn)

    def _await_listening(self, i: int) -> None:
        """Wait for API process `i` to listen; `RuntimeError` (the process ended) if it does not
        within the start timeout or cannot serve."""
        child = self._children[i]
        assert child is not None
        process, conn = child.process, child.conn
        try:
            if not conn.poll(self.start_timeout_s):
                raise RuntimeError(
                    f"the controller's API process did not start within "
                    f"{self.start_timeout_s:.0f} s"
                )
            status, detail = conn.recv()
        except (EOFError, RuntimeError) as err:
            self._end(i)
            if isinstance(err, RuntimeError):
                raise
            raise RuntimeError(
                f"the controller's API process exited while starting (code {process.exitcode})"
            ) from None
        if status != "listening":
            self._end(i)
            raise RuntimeError(f"the controller's API could not start: {detail}")

    def _watch(self) -> None:
        """Watcher thread: start each API process again when it dies, until :meth:`stop` (a
        restart that fails is tried again a second later: the API must not stay down)."""
        while not self._stopping.is_set():
            live = [c.process.sentinel for c in self._children if c is not None]
            if len(live) == self.processes:
                wait(live)
            with self._lock:
                if self._stopping.is_set():
                    return
                for i, child in enumerate(self._children):
                    if child is not None:
                        if child.process.is_alive():
                            continue
                        code = child.process.exitcode
                        self._close(i)
                        self.restarts += 1
                        log.error(
                            "the controller's API process died (exit code %s): starting it "
                            "again on port %d",
                            code,
                            self.port,
                        )
                    try:
                        self._spawn(i)
                    except RuntimeError as err:
                        log.error("%s; trying again in 1 s", err)
            if None in self._children:
                self._stopping.wait(1.0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the watcher, then ask the API processes to finish their requests and exit
        (killed after `timeout_s`), and close the port."""
        with self._lock:
            self._stopping.set()
            for i in range(self.processes):
                with contextlib.suppress(OSError):  # (it may be gone already)
                    child = self._children[i]
                    if child is not None:
                        child.conn.send("stop")
            for i in range(self.processes):
                self._end(i, timeout_s)
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout_s)

    def _end(self, i: int, timeout_s: float = 10.0) -> None:
        child = self._children[i]
        if child is None:
            return
        with contextlib.suppress(OSError):
            child.conn.send("stop")
        child.process.join(timeout_s)
        if child.process.is_alive():
            log.warning("the controller's API process did not stop: killing it")
            child.process.kill()
            child.process.join()
        self._close(i)

    def _close(self, i: int) -> None:
        child = self._children[i]
        if child is not None:
            child.conn.close()
            child.process.join()  # (reaps it)
            child.process.close()
        self._children[i] = None

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


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port` (0: any free port) for the API processes to share;
    `RuntimeError` naming the address if it cannot be bound."""
    try:
        return bind_socket(host, port, backlog=2048)
    except OSError as err:
        raise RuntimeError(
            f"the controller's API could not serve on {host}:{port}: {err}"
        ) from None


def lower_thread_priority(niceness: int) -> None:
    """Add `niceness` to the calling thread's nice value (Linux: a per-thread value; the
    process's other threads and the processes it already started keep theirs). Raising it needs
    no privilege; a platform without per-thread priorities is left as it is."""
    if niceness <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(19, current + niceness))


def _serve(spec: ApiSpec, sock: socket.socket, conn: Connection) -> None:
    """An API process: serve on the parent's listening socket `sock` until the parent says stop
    or dies."""
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
        server = serve(app, host=spec.host, sock=sock)
    except (OSError, RuntimeError, redis.RedisError) as err:
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    conn.send(("listening", server.port))
    try:
        conn.recv()  # "stop"
    except EOFError:  # the controller died
        log.warning("the controller is gone: its API process stops")
    server.stop()
