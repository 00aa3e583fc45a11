"""The replica side of the control plane: join a job, stay registered, learn when it ends.

A replica knows only the controller's address and the job's token. `ReplicaSession.join`
registers it, fetches `/api/meta` (the job's config, the Redis URL, the weight rendezvous) and
starts a heartbeat thread; from then on the replica reads and writes the job's Redis streams
directly through `session.state`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import httpx

from nebula_rl.config import Config, config_from_dict
from nebula_rl.controller.redis_server import connect
from nebula_rl.controller.state import JobState

__all__ = [
    "ADDRESS_FILE",
    "CONTROLLER_ENV",
    "REDIS_URL_ENV",
    "RESTART_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE",
    "ControllerClient",
    "ReplicaSession",
    "read_token",
]

log = logging.getLogger(__name__)

TOKEN_ENV = "NEBULA_TOKEN"
"""Environment variable holding the job's bearer token (kept off command lines, which `ps` shows)."""

CONTROLLER_ENV = "NEBULA_CONTROLLER"
"""Environment variable the inspection commands (`nebula-rl status`, ...) read HOST:PORT from."""
TOKEN_FILE = "token"
"""File in the run folder that holds the job's token (mode 0600), for the inspection commands."""
ADDRESS_FILE = "controller"
"""File in the run folder that holds the controller's HOST:PORT."""
REDIS_URL_ENV = "NEBULA_REDIS_URL"
"""Environment variable the controller reads the Redis URL (with its password) from."""
RESTART_ENV = "NEBULA_CONTROLLER_RESTART"
"""Set to "1" for a controller the launcher restarts after it died: it continues the job from
Redis instead of restoring a checkpoint (`train.resume`)."""


def read_token() -> str:
    """The job's token from the environment; a clear error when it is missing."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(f"set {TOKEN_ENV} to the job's token (the launcher does this)")
    return token


class ControllerClient:
    """Token-authenticated calls to the controller's HTTP API."""

    def __init__(self, address: str, token: str, *, timeout: float = 10.0) -> None:
        base = address if address.startswith("http") else f"http://{address}"
        self.http = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        )

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self.http.request(method, path, json=body)
        response.raise_for_status()
        return response.json()

    def meta(self) -> dict[str, Any]:
        """The job's config and join information."""
        return self._call("GET", "/api/meta")

    def status(self) -> dict[str, Any]:
        """Step, policy version, replicas, ledger."""
        return self._call("GET", "/api/status")

    def request_checkpoint(self) -> dict[str, Any]:
        """Ask for a checkpoint after the next training step."""
        return self._call("POST", "/api/checkpoint")

    def replicas(self) -> list[dict[str, Any]]:
        """Every registered replica's registry entry."""
        return self._call("GET", "/api/replicas")["replicas"]

    def replica(self, name: str) -> dict[str, Any]:
        """One replica's registry entry (`httpx.HTTPStatusError` 404 if it is not registered)."""
        return self._call("GET", f"/api/replicas/{quote(name, safe='')}")

    def register(
        self, name: str, *, role: Literal["policy", "rollout", "teacher"], world_size: int = 1
    ) -> dict[str, Any]:
        """Join the job as `name`."""
        body = {"name": name, "role": role, "host": socket.gethostname(), "world_size": world_size}
        return self._call("POST", "/api/replica/register", body)

    def heartbeat(
        self, name: str, *, policy_version: int, stats: dict[str, float]
    ) -> dict[str, Any]:
        """I am alive; the answer carries the job's step, version and outcome."""
        body = {"name": name, "policy_version": policy_version, "stats": stats}
        return self._call("POST", "/api/replica/heartbeat", body)

    def unregister(self, name: str) -> None:
        """Leave the job."""
        self._call("POST", "/api/replica/unregister", {"name": name})

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()


@dataclass
class ReplicaSession:
    """A registered replica: its config, the job's Redis state, and a heartbeat thread."""

    name: str
    """Replica name (also its Redis consumer name)."""
    role: Literal["policy", "rollout", "teacher"]
    """What it does."""
    client: ControllerClient
    """The controller's API."""
    meta: dict[str, Any]
    """`/api/meta` as fetched at join time."""
    registration: dict[str, Any]
    """The controller's answer to the registration (replica id, weight rank, ...)."""
    cfg: Config
    """The job's config (the controller's copy)."""
    state: JobState
    """The job's durable state, shared with the controller through Redis."""
    heartbeat_s: float = 2.0
    """Seconds between heartbeats."""
    policy_version: Callable[[], int] = lambda: -1
    """Reports the version of the weights this replica holds."""
    stats: Callable[[], dict[str, float]] = dict
    """Reports numbers for the dashboard."""
    world_size: int = 1
    """Processes (ranks) of the replica."""
    leader: bool = True
    """Whether this is the replica's rank 0, the one registered with the controller (the other
    ranks only read the job's config and state, see :meth:`attach`)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _ready: bool = False
    _unreachable: bool = False

    @classmethod
    def join(
        cls,
        address: str,
        *,
        name: str,
        role: Literal["policy", "rollout", "teacher"],
        world_size: int = 1,
    ) -> ReplicaSession:
        """Register with the controller at `address` (HOST:PORT) and connect to the job's Redis."""
        client = ControllerClient(address, read_token())
        meta = client.meta()
        registration = client.register(name, role=role, world_size=world_size)
        cfg = config_from_dict(meta["config"], source=f"{address}/api/meta")
        state = JobState(connect(meta["redis_url"]), meta["job"])
        heartbeat_s = max(0.2, min(2.0, cfg.controller.heartbeat_timeout / 5))
        session = cls(
            name, role, client, meta, registration, cfg, state, heartbeat_s, world_size=world_size
        )
        log.info("%s joined job %s as %s", name, meta["job"], role)
        return session

    @classmethod
    def attach(
        cls,
        address: str,
        *,
        name: str,
        role: Literal["policy", "rollout", "teacher"],
        registration: dict[str, Any],
        world_size: int,
    ) -> ReplicaSession:
        """A rank other than 0 of replica `name`, which its rank 0 registered (`registration`, the
        controller's answer): the job's config and state, no registration or heartbeats."""
        client = ControllerClient(address, read_token())
        meta = client.meta()
        cfg = config_from_dict(meta["config"], source=f"{address}/api/meta")
        state = JobState(connect(meta["redis_url"]), meta["job"])
        return cls(
            name, role, client, meta, registration, cfg, state, world_size=world_size, leader=False
        )

    def start_heartbeats(self) -> None:
        """Send heartbeats from a daemon thread until :meth:`leave` (once: later calls do
        nothing; none from ranks other than 0)."""
        if self._thread is not None or not self.leader:
            return
        self._thread = threading.Thread(target=self._beat, name="nebula-heartbeat", daemon=True)
        self._thread.start()

    def mark_ready(self) -> None:
        """The replica's model is loaded: the controller may put it into groups and give it work
        that needs them (weights, data parallelism). Rank 0 says so for the whole replica."""
        if not self.leader:
            return
        self._ready = True
        self.state.set_ready(self.name)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.client.heartbeat(
                    self.name, policy_version=self.policy_version(), stats=self.stats()
                )
            except httpx.HTTPStatusError as err:
                if err.response.status_code != 404:
                    log.warning("heartbeat refused: %s", err)
                    continue
                self._rejoin()
            except httpx.HTTPError as err:  # the next beat retries; the controller reaps laggards
                if not self._unreachable:  # once per outage (e.g. the controller restarts)
                    log.warning("heartbeat failed: %s; retrying", err)
                self._unreachable = True
            else:
                if self._unreachable:
                    log.info("the controller answers heartbeats again")
                self._unreachable = False

    def _rejoin(self) -> None:
        """The controller forgot this replica (it judged it dead while it was only slow): register
        again; the controller then treats it as a replica that joins."""
        if self._stop.is_set():
            return
        log.warning("%s was removed from the job while alive: registering again", self.name)
        try:
            self.registration = self.client.register(
                self.name, role=self.role, world_size=self.world_size
            )
        except httpx.HTTPError as err:
            log.warning("registering again failed: %s", err)
            return
        if self._ready:
            self.state.set_ready(self.name)

    def finished(self) -> str | None:
        """The job's outcome once the controller ended it, else None."""
        return self.state.finished()

    def leave(self) -> None:
        """Stop heartbeats and unregister (best effort: the controller may be gone already)."""
        self._stop.set()
        if not self.leader:
            self.client.close()
            return
        try:
            self.client.unregister(self.name)
        except httpx.HTTPError as err:
            log.info("unregister of %s failed: %s", self.name, err)
        self.client.close()
