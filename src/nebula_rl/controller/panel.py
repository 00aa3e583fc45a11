"""The controller's web dashboard: `GET /panel` (one self-contained page), `GET /api/panel`
(the JSON it polls: the replicas and the per-step metrics of `<run>/metrics.jsonl`) and
`GET /api/panel/samples?step=N` (a world-model run's sample grid of that step).

Signing in. A browser cannot send a bearer header when it navigates, so the page has its own
session: opening `/panel?token=<the job's token>` sets an HttpOnly, SameSite=Strict cookie and
redirects to `/panel`, which drops the token from the address bar. The cookie holds an HMAC of
the token, not the token, and it is only accepted for GET requests of :data:`COOKIE_PATHS`: it
lets a browser read the dashboard, never register replicas or read `/api/meta` (which holds the
Redis password). The check lives in the controller's ASGI guard (:mod:`~nebula_rl.controller.app`).

The page (`panel.html`, package data) loads nothing from elsewhere: its one script and one style
sheet are inline and allowed by their hashes in the Content-Security-Policy, which forbids every
other source, so the dashboard works on machines without internet access and a replica name can
never become markup.

Metrics. The page asks for the records changed since its last poll: `since` is the `cursor` the
previous answer gave (0 at first). A step may have several lines in `metrics.jsonl` (its
validation's `val/*` numbers come in a record of their own, after the step's): they are merged, and
a step updated by a later line is sent again, whole.

Simplification: the metrics are read from the file the scheduler appends to (the controller is
one process); a step rewritten by `train.resume` shows its newest record.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import math
import re
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Response

from nebula_rl.controller.state import JobState

__all__ = [
    "COOKIE_PATHS",
    "DATA_PATH",
    "PAGE_PATH",
    "SAMPLES_PATH",
    "MetricsLog",
    "add_panel_routes",
    "content_security_policy",
    "cookie_name",
    "login_cookie",
    "replica_rows",
    "session_value",
]

log = logging.getLogger(__name__)

PAGE_PATH = "/panel"
"""The dashboard page; `?token=...` signs a browser in."""
DATA_PATH = "/api/panel"
"""What the page polls."""
SAMPLES_PATH = "/api/panel/samples"
"""A world-model run's sample grid of a step (`<run>/samples/step_<N>.png`, PNG; with
`animated=true` a video model's animated grid, `step_<N>.gif`)."""
COOKIE_PATHS = frozenset({PAGE_PATH, DATA_PATH, SAMPLES_PATH})
"""Paths where the session cookie stands in for the bearer token (GET only)."""

_SESSION_CONTEXT = b"nebula-rl panel session v1"


def session_value(token: str) -> str:
    """The session cookie's value for `token`: an HMAC of it, so a leaked cookie does not reveal
    the bearer token that the rest of the API accepts."""
    return hmac.new(token.encode(), _SESSION_CONTEXT, hashlib.sha256).hexdigest()


def cookie_name(job: str) -> str:
    """The session cookie's name; per job, since browsers share cookies across the ports of a
    host, so two controllers on one machine would otherwise sign each other's browser out."""
    return f"nebula_panel_{job}"


def login_cookie(name: str, value: str) -> str:
    """A `Set-Cookie` value: a browser-session cookie that scripts cannot read (HttpOnly) and that
    other sites' requests do not carry (SameSite=Strict). Not `Secure`: the controller serves
    plain HTTP (put it behind TLS when it leaves a trusted network)."""
    return f"{name}={value}; Path=/; HttpOnly; SameSite=Strict"


@dataclass
class MetricsLog:
    """The steps recorded in a `metrics.jsonl`, read incrementally as the scheduler appends;
    the lines of one step are merged into one record (later values win).

    Only complete lines are consumed (the writer may be mid-line); a file that was replaced or
    shrank is read again from the start. Safe to call from several request threads.
    """

    path: Path | None
    """The file; None: no metrics (the page shows the replicas only)."""
    _records: dict[int, dict[str, float | None]] = field(default_factory=dict)
    _updated: dict[int, int] = field(default_factory=dict)
    """Step -> the cursor value of the line that last changed its record."""
    _cursor: int = 0
    """Step lines read so far, over every version of the file: it only grows."""
    _offset: int = 0
    _inode: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, cursor: int) -> tuple[list[dict[str, float | None]], int]:
        """(the records changed after `cursor`, in step order; the cursor to ask with next).
        A cursor ahead of this log's (a restarted controller's) gets every record."""
        with self._lock:
            self._read_new()
            if cursor > self._cursor:
                cursor = 0
            steps = sorted(s for s, at in self._updated.items() if at > cursor)
            return [self._records[s] for s in steps], self._cursor

    def since(self, cursor: int) -> list[dict[str, float | None]]:
        """The records changed after `cursor` (0: all), in step order."""
        return self.read(cursor)[0]

    def _read_new(self) -> None:
        if self.path is None:
            return
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self._records, self._updated, self._offset = {}, {}, 0
            self._inode = stat.st_ino
        if stat.st_size == self._offset:
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read(stat.st_size - self._offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            record = _parse(line)
            step = None if record is None else record.get("step")
            if record is None or step is None:
                # e.g. a line a crashed controller left half-written, then appended to
                if line.strip():
                    log.warning("%s: skipping a line that is not a step record", self.path)
                continue
            self._cursor += 1
            self._records[int(step)] = {**self._records.get(int(step), {}), **record}
            self._updated[int(step)] = self._cursor


def _parse(line: bytes) -> dict[str, float | None] | None:
    """The numeric fields of a metrics line (NaN and infinities become None: they are not
    JSON); None when the line is not a JSON object."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    return {
        key: value if math.isfinite(value) else None
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def replica_rows(
    replicas: dict[str, dict[str, Any]], *, now: float, heartbeat_timeout: float
) -> list[dict[str, Any]]:
    """The replica table: one row per replica, policy replicas first, each with its `state`:
    `alive`, `late` (silent for over a third of the heartbeat timeout) or `lost` (silent past
    the timeout: the scheduler removes it at its next reap)."""
    rows = []
    for name, info in replicas.items():
        age = max(0.0, now - info["last_heartbeat"])
        if age > heartbeat_timeout:
            state = "lost"
        elif age > heartbeat_timeout / 3:
            state = "late"
        else:
            state = "alive"
        tokens_per_s = info["stats"].get("tokens_per_s")
        rows.append(
            {
                "name": name,
                "role": info["role"],
                "state": state,
                "host": info["host"],
                "world_size": info["world_size"],
                "last_heartbeat": info["last_heartbeat"],
                "heartbeat_age_s": age,
                "policy_version": info["policy_version"],
                "tokens_per_s": tokens_per_s,
            }
        )
    rows.sort(key=lambda r: (r["role"] != "policy", r["name"]))
    return rows


def content_security_policy(html: str) -> str:
    """The Content-Security-Policy for page `html`: only its inline `<script>` and `<style>`
    (by hash), requests and images (the sample grids) of its own origin; nothing is loaded
    from anywhere else."""
    hashes = {}
    for tag in ("script", "style"):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
        assert len(blocks) == 1, f"panel.html must have exactly one inline <{tag}>"
        digest = hashlib.sha256(blocks[0].encode()).digest()
        hashes[tag] = f"'sha256-{base64.b64encode(digest).decode()}'"
    return (
        f"default-src 'none'; script-src {hashes['script']}; style-src {hashes['style']}; "
        "connect-src 'self'; img-src data: 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


def add_panel_routes(
    app: FastAPI,
    *,
    state: JobState,
    meta: dict[str, Any],
    metrics_path: Path | None,
    heartbeat_timeout: float,
) -> None:
    """Serve the dashboard of `state`'s job on `app` (authentication is the guard's job)."""
    html = resources.files("nebula_rl.controller").joinpath("panel.html").read_text("utf-8")
    page_headers = {
        "Content-Security-Policy": content_security_policy(html),
        "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
    }
    metrics = MetricsLog(metrics_path)
    samples = None if metrics_path is None else metrics_path.parent / "samples"

    def latest_samples() -> int | None:
        """The last step with a sample grid (a world-model run's `logging.multi_modal_log_interval`)."""
        if samples is None or not samples.is_dir():
            return None
        found = [
            int(m[1]) for f in samples.iterdir() if (m := re.fullmatch(r"step_(\d+)\.png", f.name))
        ]
        return max(found, default=None)

    @app.get(PAGE_PATH, include_in_schema=False)
    def panel() -> Response:
        """The dashboard page."""
        return Response(html, media_type="text/html; charset=utf-8", headers=page_headers)

    @app.get(DATA_PATH)
    def panel_data(response: Response, since: int = Query(0, ge=0, le=1 << 53)) -> dict[str, Any]:
        """Where the job stands, its replicas, and the step records changed since the cursor
        `since` (the `cursor` of a previous answer; 0: all of them)."""
        response.headers["Cache-Control"] = "no-store"
        records, cursor = metrics.read(since)
        latest = latest_samples()
        animated = (
            latest is not None
            and samples is not None
            and (samples / f"step_{latest}.gif").is_file()
        )  # (a video model's grid plays)
        return {
            "job": state.job,
            "step": state.step(),
            "total_steps": meta.get("total_steps"),
            "policy_version": state.policy_version(),
            "buffer_size": state.buffer_size(),
            "finished": state.finished(),
            "heartbeat_timeout": heartbeat_timeout,
            "replicas": replica_rows(
                state.replicas(), now=state.clock(), heartbeat_timeout=heartbeat_timeout
            ),
            "metrics": records,
            "cursor": cursor,
            "samples_step": latest,
            "samples_animated": animated,
        }

    @app.get(SAMPLES_PATH)
    def panel_samples(step: int = Query(ge=0, le=1 << 53), animated: bool = False) -> Response:
        """The sample grid of `step` (PNG; `animated`: a video model's animated GIF of it);
        404 when that step has none."""
        suffix, media = (".gif", "image/gif") if animated else (".png", "image/png")
        path = None if samples is None else samples / f"step_{step}{suffix}"
        if path is None or not path.is_file():
            what = "animated sample grid" if animated else "sample grid"
            raise HTTPException(status_code=404, detail=f"no {what} of step {step}")
        return Response(path.read_bytes(), media_type=media, headers={"Cache-Control": "no-store"})
