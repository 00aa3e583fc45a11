"""The reward service over HTTP: the FastAPI app (token guard, enqueue, pull, ping, health),
its socket, and starting and running the whole service."""

from __future__ import annotations

import json
import logging
import signal
import socket
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from nebula_rl.rewards.service.config import RewardServiceConfig, resolve_token
from nebula_rl.rewards.service.pool import RewardService
from nebula_rl.rewards.service.wire import (
    ENQUEUE_PATH,
    HEALTH_PATH,
    MAX_FORM_BYTES,
    PING_PATH,
    PULL_PATH,
    RequestError,
    bad_request,
    parse_enqueue,
)
from nebula_rl.utils.http_server import HttpServer, bearer_matches, serve
from nebula_rl.utils.net import bind_socket as _bind

log = logging.getLogger(__name__)


# HTTP


class _BearerGuard:
    """ASGI middleware: the token check (all but `/health`), before anything is read or parsed;
    tokens are compared in constant time and never logged."""

    def __init__(self, app: ASGIApp, *, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] != HEALTH_PATH
            and not bearer_matches(scope, self.token)
        ):
            body = json.dumps({"message": "missing or invalid bearer token"}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the body exceeds {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _form(request: Request) -> dict[str, str]:
    """The url-encoded form fields of the body (first value of each)."""
    if request.headers.get("content-type", "").startswith("multipart/"):
        raise RequestError(
            415, "send the form fields url-encoded (application/x-www-form-urlencoded)"
        )
    body = await _read_body(request, MAX_FORM_BYTES)
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=16)
    except (UnicodeDecodeError, ValueError) as err:
        raise RequestError(400, f"the body is not a url-encoded form: {err}") from None
    return {key: values[0] for key, values in fields.items()}


def create_app(service: RewardService, *, token: str) -> FastAPI:
    """The HTTP API over `service`: enqueue, pull, ping (bearer `token`) and `/health`."""
    if not token:
        raise ValueError("the reward service needs a non-empty bearer token")
    app = FastAPI(title="nebula-rl reward service", docs_url=None, redoc_url=None)
    app.add_middleware(_BearerGuard, token=token)
    max_body = int(service.cfg.max_body_mb * (1 << 20))

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse({"message": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback; the caller gets no internals.
        return JSONResponse({"message": "internal server error"}, status_code=500)

    @app.get(HEALTH_PATH)
    def health() -> dict[str, str]:
        """Liveness probe; needs no token."""
        return {"status": "ok"}

    @app.post(ENQUEUE_PATH)
    async def enqueue(request: Request) -> dict[str, str]:
        """Queue a batch (`<JSON>\\n<npy bytes>`) for scoring; its uuid."""
        body = await _read_body(request, max_body)
        parsed = await run_in_threadpool(parse_enqueue, body, service.rewards, service.text_rewards)
        return {"uuid": service.submit(parsed)}

    @app.post(PULL_PATH)
    async def pull(request: Request) -> dict[str, Any]:
        """One reward's scores of a task (form `uuid`, `type`); 400 while not ready."""
        form = await _form(request)
        if not form.get("uuid"):
            raise bad_request("the form field `uuid` is missing")
        return service.result(form["uuid"], form.get("type") or None)

    @app.post(PING_PATH)
    async def ping(request: Request) -> dict[str, Any]:
        """Whether the service runs, and its load (form `info_data` optional, logged)."""
        info = (await _form(request)).get("info_data")
        if info:
            log.debug("ping: %s", info[:1000])
        return {"status": "ok", **service.stats()}

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (0: any free port); a port in use is a `ValueError`."""
    try:
        sock = _bind(host, port)
    except OSError as err:
        raise ValueError(
            f"cannot listen on {host}:{port} ({err.strerror}): free the port or choose another "
            "`port` (--port); the service does not move to another port by itself"
        ) from None
    sock.set_inheritable(True)
    return sock


@dataclass
class RunningService:
    """A reward service answering HTTP from a background thread (tests, embedding)."""

    service: RewardService
    """The queue and the workers."""
    http: HttpServer
    """The HTTP server and its thread."""
    token: str
    """The bearer token clients must send."""

    @property
    def url(self) -> str:
        """`http://host:port`."""
        return self.http.url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the HTTP server, then the workers."""
        try:
            self.http.stop(timeout_s)
        finally:
            self.service.stop(timeout_s)

    def __enter__(self) -> RunningService:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_service(
    cfg: RewardServiceConfig, *, token: str | None = None, timeout_s: float = 120.0
) -> RunningService:
    """Start the workers and serve HTTP in a daemon thread; returns once both are ready."""
    token = token or resolve_token(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    service = RewardService(cfg)
    try:
        service.start(timeout_s)
    except BaseException:
        sock.close()
        raise
    try:
        http = serve(
            create_app(service, token=token), host=cfg.host, sock=sock, timeout=timeout_s,
            name="reward-service-http", lifespan="off",
        )  # fmt: skip
    except BaseException:
        service.stop()
        raise
    return RunningService(service, http, token)


def _uvicorn(app: FastAPI) -> uvicorn.Server:
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, server_header=False, lifespan="off"
    )
    return uvicorn.Server(config)


def run_service(cfg: RewardServiceConfig) -> None:
    """Serve in this (main) thread until SIGINT or SIGTERM, then stop the workers and return.

    A port in use is a `ValueError` before any worker starts."""
    token = resolve_token(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    server: uvicorn.Server | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if server is None:  # still starting the workers: give up starting
            raise KeyboardInterrupt
        # (uvicorn handles signals while it runs and raises them again after its shutdown)
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    service = RewardService(cfg)
    try:
        service.start()
        server = _uvicorn(create_app(service, token=token))
        log.info(
            "reward service on http://%s:%d: %s (%d worker(s), max_pending %d)",
            cfg.host,
            sock.getsockname()[1],
            ", ".join(service.rewards),
            cfg.num_workers,
            cfg.max_pending,
        )
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        log.info("interrupted while starting")
    finally:
        service.stop()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("reward service stopped")
