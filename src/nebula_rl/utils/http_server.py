"""A uvicorn server in a background thread: the controller's API and the reward service."""

from __future__ import annotations

import hmac
import socket
import threading
import time
from dataclasses import dataclass
from types import TracebackType

import uvicorn
from fastapi import FastAPI
from starlette.types import Scope

__all__ = ["HttpServer", "bearer_matches", "serve"]


def bearer_matches(scope: Scope, token: bytes) -> bool | None:
    """Whether the request's `Authorization: Bearer <token>` is `token` (compared in constant
    time); None when it has no Authorization header."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, credentials = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), token)
    return None


@dataclass
class HttpServer:
    """A uvicorn server running in a background thread."""

    server: uvicorn.Server
    """The server."""
    thread: threading.Thread
    """The thread running it."""
    host: str
    """Bound interface."""
    port: int
    """Bound port."""

    @property
    def url(self) -> str:
        """`http://host:port`."""
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the server to exit and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"HTTP server did not stop within {timeout:.0f} s")

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    sock: socket.socket | None = None,
    timeout: float = 10.0,
    name: str = "http",
    lifespan: str = "auto",
) -> HttpServer:
    """Start `app` under uvicorn in a daemon thread; returns once it listens (port 0: any free;
    `sock`: an already bound socket, whose address wins)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, server_header=False,
        lifespan=lifespan,  # type: ignore[arg-type]
    )  # fmt: skip
    server = uvicorn.Server(config)
    kwargs = {"sockets": [sock]} if sock is not None else {}
    thread = threading.Thread(target=server.run, kwargs=kwargs, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"HTTP server failed to start on {host}:{port} (see the log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"HTTP server did not start within {timeout:.0f} s")
        time.sleep(0.01)
    bound = (
        sock.getsockname()[1] if sock is not None else server.servers[0].sockets[0].getsockname()[1]
    )
    return HttpServer(server, thread, host, bound)
