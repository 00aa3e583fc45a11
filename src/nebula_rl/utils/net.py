"""Network helpers without torch (the controller process uses them)."""

from __future__ import annotations

import socket

__all__ = ["bind_socket", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def bind_socket(host: str, port: int, *, backlog: int | None = None) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: any free port) with SO_REUSEADDR (as uvicorn
    binds), listening with `backlog` when given. If it cannot be bound, the socket is closed
    and the `OSError` raised."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        if backlog is not None:
            sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
