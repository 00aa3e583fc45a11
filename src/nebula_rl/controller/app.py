"""The controller's HTTP API: the control plane (register, heartbeat, unregister, meta, status,
replicas).

Prompts, completions and training batches do not pass through HTTP: replicas read and write the
Redis streams of :class:`~nebula_rl.controller.state.JobState` directly, with the Redis URL they
get from `/api/meta`. Every endpoint but `/health` needs `Authorization: Bearer <token>`; the
web dashboard (`/panel`, :mod:`~nebula_rl.controller.panel`) also takes the session cookie a
browser gets by opening `/panel?token=<token>` once.

Input is untrusted: the token and the body size are checked before anything is parsed, bodies are
pydantic models that forbid unknown fields and bound every string and number, so bad input gets a
4xx answer. A 5xx means a bug in the controller (or, 503, Redis being unreachable).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs

import redis
from fastapi import FastAPI, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from redis.asyncio import BlockingConnectionPool as AsyncBlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio import UnixDomainSocketConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nebula_rl.controller import panel
from nebula_rl.controller.state import JobState
from nebula_rl.utils import http_server
from nebula_rl.utils.http_server import HttpServer, bearer_matches

__all__ = [
    "MAX_BODY_BYTES",
    "HeartbeatRequest",
    "HttpServer",
    "RegisterRequest",
    "UnregisterRequest",
    "create_app",
    "serve",
]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
"""Largest request body accepted (413 beyond)."""
PUBLIC_PATHS = frozenset({"/health"})
"""Paths served without a token."""

REPLICA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}$"
"""What a replica name may be."""
ReplicaName = Annotated[str, StringConstraints(pattern=REPLICA_NAME_PATTERN)]
HostName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:%\[\]-]{1,255}$")]
StatName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_./:-]{1,64}$")]
StatValue = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class RegisterRequest(_Body):
    """A replica joins (or rejoins after a restart) the job."""

    name: ReplicaName
    """Unique replica name; rollout replicas also use it as their Redis consumer name."""
    role: Literal["policy", "rollout", "teacher"]
    """What the replica does."""
    host: HostName
    """Host name or address where its rank 0 runs."""
    world_size: int = Field(ge=1, le=1 << 20)
    """Processes in the replica's torchrun group."""


class HeartbeatRequest(_Body):
    """A replica is alive."""

    name: ReplicaName
    """Registered replica name."""
    policy_version: int = Field(ge=-1, le=1 << 53)
    """Version of the weights it holds (-1: none yet)."""
    stats: dict[StatName, StatValue] = Field(default_factory=dict, max_length=64)
    """Free-form numbers for the dashboard (e.g. `tokens_per_s`)."""


class UnregisterRequest(_Body):
    """A replica leaves the job."""

    name: ReplicaName
    """Registered replica name."""


class _LoopClients:
    """asyncio Redis clients of the server `sync` talks to, one per event loop (a client's
    connections belong to the loop that opened them; tests serve one app from several).

    Each holds at most :attr:`MAX_CONNECTIONS` connections and a request waits for a free one:
    a burst of heartbeats from a thousand replicas would otherwise open a connection each (or,
    past redis-py's default pool size, fail)."""

    MAX_CONNECTIONS = 32
    _KEYS = ("host", "port", "path", "db", "username", "password", "socket_timeout",
             "socket_connect_timeout", "decode_responses")  # fmt: skip
    """The connection settings an asyncio client takes as they are."""

    def __init__(self, sync: redis.Redis) -> None:
        given = sync.connection_pool.connection_kwargs
        self.kwargs = {k: given[k] for k in self._KEYS if k in given}
        if "path" in given:
            self.kwargs["connection_class"] = UnixDomainSocketConnection
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncRedis] = (
            weakref.WeakKeyDictionary()
        )

    def get(self) -> AsyncRedis:
        """The running loop's client."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            pool = AsyncBlockingConnectionPool(
                max_connections=self.MAX_CONNECTIONS, timeout=20, **self.kwargs
            )
            client = self._clients[loop] = AsyncRedis(connection_pool=pool)
        return client


class _Guard:
    """ASGI middleware: token check (all but :data:`PUBLIC_PATHS`) and body size cap, both before
    FastAPI parses anything, so an unauthenticated caller learns nothing from validation errors.

    The dashboard's sign-in is handled here too: `GET /panel?token=<token>` answers with the
    session cookie and a redirect to `/panel`; the cookie then authorizes GET requests of
    :data:`~nebula_rl.controller.panel.COOKIE_PATHS` only. Tokens are compared in constant time
    and never logged.
    """

    def __init__(self, app: ASGIApp, *, token: str, max_body_bytes: int, cookie: str) -> None:
        self.app = app
        self.token = token.encode()
        self.max_body_bytes = max_body_bytes
        self.cookie = cookie.encode()
        self.session = panel.session_value(token).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        login = self._login_token(scope)
        if login is not None:
            await self._sign_in(send, login)
            return
        if scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
            detail = "missing or invalid bearer token"
            if scope["path"] in panel.COOKIE_PATHS:
                detail += f"; sign a browser in by opening {panel.PAGE_PATH}?token=<job token>"
            await _reply(send, 401, detail, [(b"www-authenticate", b"Bearer")])
            return
        body = await self._read_body(receive)
        if body is None:  # the client left
            return
        if len(body) > self.max_body_bytes:
            await _reply(send, 413, f"request body exceeds {self.max_body_bytes} bytes")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        matches = bearer_matches(scope, self.token)
        if matches is not None:
            return matches
        if scope["method"] == "GET" and scope["path"] in panel.COOKIE_PATHS:
            return self._has_session(scope)
        return False

    def _has_session(self, scope: Scope) -> bool:
        """Whether the request carries the dashboard's session cookie."""
        for name, value in scope["headers"]:
            if name != b"cookie":
                continue
            for pair in value.split(b";"):
                key, _, cookie = pair.strip().partition(b"=")
                if key == self.cookie and hmac.compare_digest(cookie, self.session):
                    return True
        return False

    @staticmethod
    def _login_token(scope: Scope) -> bytes | None:
        """The `token` query parameter of `GET /panel?token=...`, else None."""
        if scope["method"] != "GET" or scope["path"] != panel.PAGE_PATH:
            return None
        query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        if "token" not in query:
            return None
        values = query["token"]
        return values[0].encode() if len(values) == 1 else b""

    async def _sign_in(self, send: Send, token: bytes) -> None:
        """Trade a valid token for the session cookie and send the browser to the bare page."""
        if not hmac.compare_digest(token, self.token):
            await _reply(send, 401, "invalid token", [(b"www-authenticate", b"Bearer")])
            return
        cookie = panel.login_cookie(self.cookie.decode(), self.session.decode())
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", panel.PAGE_PATH.encode()),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The body, read no further than one chunk past the cap; None if the client left."""
        chunks, size, more = [], 0, True
        while more and size <= self.max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        return b"".join(chunks)


async def _reply(
    send: Send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def create_app(
    *,
    state: JobState,
    config_json: dict[str, Any],
    token: str,
    meta_extra: dict[str, Any] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    on_register: Callable[[RegisterRequest], dict[str, Any]] | None = None,
    metrics_path: Path | None = None,
    heartbeat_timeout: float = 30.0,
) -> FastAPI:
    """The controller API over `state`; `/api/meta` returns `config_json` and `meta_extra`.

    `on_register` adds fields to the answer of a registration (e.g. the replica's rank in the
    weight group); a `ValueError` from it refuses the replica with 409. The dashboard plots the
    steps of `metrics_path` (the scheduler's `metrics.jsonl`) and calls a replica late or lost
    by `heartbeat_timeout` (seconds).
    """
    if not token:
        raise ValueError("the controller needs a non-empty bearer token")
    meta = {"job": state.job, "config": config_json, **(meta_extra or {})}
    app = FastAPI(title="nebula-rl controller", docs_url=None, redoc_url=None)
    app.add_middleware(
        _Guard, token=token, max_body_bytes=max_body_bytes, cookie=panel.cookie_name(state.job)
    )

    _add_error_handlers(app)
    _add_replica_routes(app, state, config_json, on_register)
    _add_job_routes(app, state, meta)
    panel.add_panel_routes(
        app,
        state=state,
        meta=meta,
        metrics_path=metrics_path,
        heartbeat_timeout=heartbeat_timeout,
    )
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Bad requests answer 4xx with no internals; Redis down, 503."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only loc/msg/type: the default also echoes the input, up to a megabyte of it.
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(redis.ConnectionError)
    async def redis_down(request: Request, exc: redis.ConnectionError) -> JSONResponse:
        log.error("Redis is unreachable: %s", exc)
        return JSONResponse({"detail": "state store unavailable"}, status_code=503)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback; the caller gets no internals.
        return JSONResponse({"detail": "internal server error"}, status_code=500)


def _add_replica_routes(
    app: FastAPI,
    state: JobState,
    config_json: dict[str, Any],
    on_register: Callable[[RegisterRequest], dict[str, Any]] | None,
) -> None:
    """Health, and what replicas call: register, heartbeat, unregister."""

    @app.get("/health")
    def health() -> dict[str, str]:
        """Liveness probe; needs no token."""
        return {"status": "ok"}

    @app.post("/api/replica/register")
    def register(req: RegisterRequest) -> dict[str, Any]:
        """Add a replica; returns its id and where the job stands."""
        try:
            extra = on_register(req) if on_register is not None else {}
        except ValueError as err:
            raise HTTPException(409, str(err)) from None
        if req.role == "rollout" and config_json.get("mode") == "colocated":
            raise HTTPException(
                409,
                'mode = "colocated": the policy replicas generate; a rollout replica would '
                "never receive their weights (start another policy replica instead)",
            )
        # A replica that rejoins under its old name has lost the prompts it held (a rollout's,
        # or a colocated policy replica's; other policy replicas hold none).
        state.requeue_pending(req.name)
        replica_id = state.register_replica(
            req.name, role=req.role, host=req.host, world_size=req.world_size
        )
        return {
            "replica_id": replica_id,
            "policy_version": state.policy_version(),
            "step": state.step(),
            **extra,
        }

    clients = _LoopClients(state.redis)

    @app.post("/api/replica/heartbeat")
    async def heartbeat(req: HeartbeatRequest) -> dict[str, Any]:
        """Record liveness; 404 tells a replica the controller forgot it and it must re-register.
        (On the event loop with an asyncio Redis client: the most frequent request skips the
        thread pool that the other handlers run in.)"""
        job = await state.heartbeat_async(
            clients.get(), req.name, policy_version=req.policy_version, stats=req.stats
        )
        if job is None:
            raise HTTPException(404, f"replica {req.name} is not registered")
        return job

    @app.post("/api/replica/unregister")
    def unregister(req: UnregisterRequest) -> dict[str, Any]:
        """Remove a replica; prompts it still held go back to the queue."""
        state.requeue_pending(req.name)
        if not state.unregister_replica(req.name):
            raise HTTPException(404, f"replica {req.name} is not registered")
        return {"ok": True}


def _add_job_routes(app: FastAPI, state: JobState, meta: dict[str, Any]) -> None:
    """What people and tools ask: checkpoint, meta, status, replicas."""

    @app.post("/api/checkpoint")
    def request_checkpoint() -> dict[str, Any]:
        """Save a checkpoint after the next training step (what a scheduler's pre-emption
        signal asks for, `train.save_ckpt_at_exit`); the job goes on."""
        state.request_checkpoint()
        return {"ok": True}

    @app.get("/api/meta")
    def get_meta() -> dict[str, Any]:
        """The job's config and what replicas need to join it (e.g. the Redis URL)."""
        return meta

    @app.get("/api/status")
    def status() -> dict[str, Any]:
        """Step, policy version, replicas and the ledger of every epoch."""
        return {
            "job": state.job,
            "step": state.step(),
            "policy_version": state.policy_version(),
            "buffer_size": state.buffer_size(),
            "finished": state.finished(),
            "replicas": state.replicas(),
            "ledger": {str(e): state.ledger_summary(e) for e in state.epochs()},
        }

    @app.get("/api/replicas")
    def list_replicas() -> dict[str, Any]:
        """Every registered replica (policy replicas first), as `/api/replicas/{name}` shows it."""
        now, replicas = state.clock(), state.replicas()
        names = sorted(replicas, key=lambda n: (replicas[n]["role"] != "policy", n))
        return {"replicas": [_replica_view(n, replicas[n], now=now) for n in names]}

    @app.get("/api/replicas/{name}")
    def get_replica(
        name: Annotated[str, PathParam(pattern=REPLICA_NAME_PATTERN)],
    ) -> dict[str, Any]:
        """One replica's registry entry; 404 if no replica of that name is registered."""
        info = state.replicas().get(name)
        if info is None:
            raise HTTPException(404, f"replica {name} is not registered")
        return _replica_view(name, info, now=state.clock())


def _replica_view(name: str, info: dict[str, Any], *, now: float) -> dict[str, Any]:
    """A registry entry as the API shows it: with its name and the seconds since it registered
    and since its last heartbeat (measured on the controller's clock, not the caller's)."""
    return {
        "name": name,
        **info,
        "age_s": max(0.0, now - info["registered_at"]),
        "heartbeat_age_s": max(0.0, now - info["last_heartbeat"]),
    }


def serve(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    sock: socket.socket | None = None,
    timeout: float = 10.0,
) -> HttpServer:
    """Start `app` under uvicorn in a daemon thread; returns once it listens (port 0: any free;
    `sock`: an already listening socket, whose address wins)."""
    return http_server.serve(
        app, host=host, port=port, sock=sock, timeout=timeout, name="controller-http"
    )
