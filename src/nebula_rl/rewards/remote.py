"""The trainer's side of a reward service (`nebula-rl reward-service`, or cosmos-rl's): send
generated samples (images, videos, or a language model's completions: `enqueue_text`), get each
reward's scores back, never stall the job.

    client = RemoteRewardClient.from_env()   # REMOTE_REWARD_* (or cosmos-rl's WFM_REWARD_*)
    rewards = client.score(samples, prompts, {"brightness": 1.0, "colour_match": 0.5})
    if rewards is None:  # the service failed or the deadline passed: substitute, e.g. the
        ...              # group mean, so that the advantage is 0

`enqueue` retries connection errors, 429 and 5xx answers with exponential backoff (0.2 s doubling
up to 5 s, with jitter) until `deadline_s`; `pull` polls each reward until it is ready (400 means
"not yet"; polled after 0.05 s doubling up to 1 s), and returns None when the deadline passes or
the service says scoring failed (422).
A uuid's scores are taken once: a second `pull` of the same uuid raises `ValueError`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx
import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ENQUEUE_URL_ENVS",
    "FETCH_URL_ENVS",
    "TOKEN_ENVS",
    "RemoteRewardClient",
    "RemoteRewardError",
    "encode_request",
    "encode_text_request",
]

log = logging.getLogger(__name__)

TOKEN_ENVS = ("REMOTE_REWARD_TOKEN", "WFM_REWARD_TOKEN")
"""Where `from_env` reads the bearer token, first found wins (WFM_*: cosmos-rl's names)."""
ENQUEUE_URL_ENVS = ("REMOTE_REWARD_ENQUEUE_URL", "WFM_REWARD_ENQUEUE_URL")
"""Where `from_env` reads the enqueue URL (`http://host:port/api/reward/enqueue`)."""
FETCH_URL_ENVS = ("REMOTE_REWARD_FETCH_URL", "WFM_REWARD_FETCH_URL")
"""Where `from_env` reads the pull URL (`http://host:port/api/reward/pull`)."""
TAKEN_MEMORY = 100_000
"""Uuids a client remembers having pulled (uuid4s never repeat; this only bounds memory)."""


class RemoteRewardError(RuntimeError):
    """The reward service could not be reached or kept answering "busy" until the deadline."""


def _env(names: Sequence[str]) -> str:
    return next((os.environ[n] for n in names if os.environ.get(n)), "")


def encode_request(
    samples: Tensor | np.ndarray,
    prompts: Sequence[str],
    reward_fn: Mapping[str, float],
    media_type: str = "latent",
    video_infos: Sequence[Mapping[str, Any]] | None = None,
) -> bytes:
    """An enqueue body, `<JSON>\\n<npy bytes>`: `samples` as the layout of `media_type` says
    (latent: floats [B, C, T, H, W] in [-1, 1], bfloat16 sent as its bytes as cosmos-rl does;
    video: [B, C, T, H, W] of 0..255; image: [B, H, W, C] of 0..255)."""
    if media_type not in ("latent", "video", "image"):
        raise ValueError(f"media_type {media_type!r}: one of latent, video, image")
    if isinstance(samples, Tensor):
        samples = samples.detach().cpu()
        if samples.dtype == torch.bfloat16:  # numpy has no bfloat16: its bytes, half the size
            array = samples.contiguous().view(torch.uint8).numpy()
        else:
            array = samples.numpy()
    else:
        array = np.asarray(samples)
    if array.ndim == 0 or array.shape[0] != len(prompts):
        raise ValueError(
            f"{array.shape[0] if array.ndim else 0} samples but {len(prompts)} prompts"
        )
    header: dict[str, Any] = {
        "prompts": list(prompts),
        "reward_fn": dict(reward_fn),
        "media_type": media_type,
    }
    if video_infos is not None:
        header["video_infos"] = [dict(v) for v in video_infos]
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return json.dumps(header).encode() + b"\n" + buffer.getvalue()


def encode_text_request(
    prompts: Sequence[str],
    completions: Sequence[str],
    references: Sequence[str],
    reward_fn: Mapping[str, float],
) -> bytes:
    """An enqueue body for text rewards, `<JSON>\\n` (`media_type = "text"`): one completion and
    its prompt's reference answer per prompt."""
    if not len(prompts) == len(completions) == len(references):
        raise ValueError(
            f"{len(prompts)} prompts, {len(completions)} completions, {len(references)} references"
        )
    header = {
        "prompts": list(prompts),
        "completions": list(completions),
        "references": list(references),
        "reward_fn": dict(reward_fn),
        "media_type": "text",
    }
    return json.dumps(header).encode() + b"\n"


class _Backoff:
    """Exponential delays with jitter: `base`, doubling, capped at `cap`; each one drawn
    uniformly from its upper half so that clients retrying together spread out."""

    def __init__(self, base: float, cap: float) -> None:
        self.base, self.cap, self.tries = base, cap, 0

    def next(self) -> float:
        """The next delay in seconds."""
        delay = min(self.cap, self.base * 2**self.tries)
        self.tries += 1
        return delay * random.uniform(0.5, 1.0)


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        return str(data.get("message") or data.get("detail") or data)[:500]
    return str(data)[:500]


def _retry_after(response: httpx.Response) -> float:
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return 0.0


class RemoteRewardClient:
    """Scores samples with a reward service over HTTP, with retries and a deadline per call.

    `timeout_s` bounds one HTTP request; `deadline_s` bounds a whole `enqueue` (with its
    retries) and a whole `pull`. Errors are retried after `backoff_base_s` doubling up to
    `backoff_max_s`; a not-ready result is polled again after `poll_base_s` doubling up to
    `poll_max_s` (a 400 is cheap, and a longer wait only delays the trainer)."""

    def __init__(
        self,
        enqueue_url: str,
        fetch_url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        deadline_s: float = 600.0,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 5.0,
        poll_base_s: float = 0.05,
        poll_max_s: float = 1.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not enqueue_url or not fetch_url:
            raise ValueError("give the reward service's enqueue and fetch (pull) URLs")
        self.enqueue_url = enqueue_url
        self.fetch_url = fetch_url
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.poll_base_s = poll_base_s
        self.poll_max_s = poll_max_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        self._taken: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, **kwargs: Any) -> RemoteRewardClient:
        """A client configured by $REMOTE_REWARD_TOKEN, $REMOTE_REWARD_ENQUEUE_URL and
        $REMOTE_REWARD_FETCH_URL, or cosmos-rl's $WFM_REWARD_* names (REMOTE_* win); `kwargs`
        go to the constructor."""
        enqueue_url, fetch_url = _env(ENQUEUE_URL_ENVS), _env(FETCH_URL_ENVS)
        for url, names, path in (
            (enqueue_url, ENQUEUE_URL_ENVS, "enqueue"),
            (fetch_url, FETCH_URL_ENVS, "pull"),
        ):
            if not url:
                raise ValueError(
                    f"set {' or '.join(names)} to the reward service's {path} URL (e.g. "
                    f"http://127.0.0.1:8080/api/reward/{path})"
                )
        token = _env(TOKEN_ENVS)
        if not token:
            raise ValueError(f"set {' or '.join(TOKEN_ENVS)} to the reward service's token")
        return cls(enqueue_url, fetch_url, token, **kwargs)

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def __enter__(self) -> RemoteRewardClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _post(self, url: str, deadline: float, **kwargs: Any) -> httpx.Response:
        """One POST, its timeout cut to what is left of `deadline`."""
        left = max(0.1, deadline - time.monotonic())
        return self._http.post(url, timeout=min(self.timeout_s, left), **kwargs)

    def enqueue(
        self,
        samples: Tensor | np.ndarray,
        prompts: Sequence[str],
        reward_fn: Mapping[str, float],
        media_type: str = "latent",
        video_infos: Sequence[Mapping[str, Any]] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> str:
        """Send a batch to score; its uuid. Retries connection errors, 429 and 5xx until
        `deadline_s` (the client's by default), then raises :class:`RemoteRewardError`; a request
        the service refuses (other 4xx) raises `ValueError` with its message, a refused token
        `PermissionError`."""
        body = encode_request(samples, prompts, reward_fn, media_type, video_infos)
        return self._enqueue(body, deadline_s)

    def enqueue_text(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        references: Sequence[str],
        reward_fn: Mapping[str, float],
        *,
        deadline_s: float | None = None,
    ) -> str:
        """Send completions (each with its prompt's reference answer) to score with text
        rewards; its uuid. Retries and raises as :meth:`enqueue`."""
        body = encode_text_request(prompts, completions, references, reward_fn)
        return self._enqueue(body, deadline_s)

    def _enqueue(self, body: bytes, deadline_s: float | None) -> str:
        deadline = time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)
        backoff = _Backoff(self.backoff_base_s, self.backoff_max_s)
        attempt = 0
        while True:
            attempt += 1
            wait = 0.0
            try:
                response = self._post(
                    self.enqueue_url,
                    deadline,
                    content=body,
                    headers={"Content-Type": "application/octet-stream"},
                )
            except httpx.TransportError as err:
                reason = f"{type(err).__name__}: {err}"
            else:
                code = response.status_code
                if code == 200:
                    uuid = str(response.json()["uuid"])
                    if attempt > 1:
                        log.info("reward enqueue succeeded at attempt %d: %s", attempt, uuid)
                    return uuid
                if code == 401:
                    raise PermissionError(
                        f"the reward service at {self.enqueue_url} refused the token (401)"
                    )
                if code != 429 and code < 500:
                    raise ValueError(
                        f"the reward service refused the batch (HTTP {code}): {_message(response)}"
                    )
                reason, wait = f"HTTP {code}: {_message(response)}", _retry_after(response)
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("reward enqueue gave up after %d attempts: %s", attempt, reason)
                raise RemoteRewardError(
                    f"the reward service at {self.enqueue_url} did not take the batch in "
                    f"{attempt} attempts ({reason})"
                )
            delay = min(left, max(backoff.next(), wait))
            log.info(
                "reward enqueue attempt %d failed (%s); retrying in %.2f s", attempt, reason, delay
            )
            time.sleep(delay)

    def pull(
        self,
        uuid: str,
        reward_names: Sequence[str],
        *,
        score_keys: Mapping[str, str] | None = None,
        deadline_s: float | None = None,
    ) -> dict[str, list[float]] | None:
        """Each reward's scores of task `uuid`, polled until ready; None when `deadline_s` (the
        client's by default) passes or the service says scoring failed (422).

        A reward's answer holds scores by key: its own name's (nebula-rl's rewards), or several
        (cosmos-rl's `dance_grpo`: `overall_reward`, `vq_reward`, ...). `score_keys` picks the
        key of each reward (default: its name); `a+b` sums two. A key the answer lacks raises
        `ValueError` naming those it has.

        A uuid is pulled once: pulling it again raises `ValueError`, whatever the first pull
        returned (a caller that substituted a value must not later count real scores too)."""
        names = list(reward_names)
        if not names:
            raise ValueError("reward_names: name at least one reward to pull")
        with self._lock:
            if uuid in self._taken:
                raise ValueError(f"the scores of {uuid} were pulled already")
            self._taken[uuid] = None
            while len(self._taken) > TAKEN_MEMORY:
                self._taken.popitem(last=False)
        start = time.monotonic()
        deadline = start + (self.deadline_s if deadline_s is None else deadline_s)
        out: dict[str, list[float]] = {}
        keys = dict(score_keys or {})
        for name in names:
            scores = self._pull_one(uuid, name, keys.get(name) or name, deadline)
            if scores is None:
                return None
            out[name] = scores
        log.debug("pulled %s (%s) in %.2f s", uuid, ", ".join(names), time.monotonic() - start)
        return out

    def _pull_one(self, uuid: str, name: str, key: str, deadline: float) -> list[float] | None:
        poll = _Backoff(self.poll_base_s, self.poll_max_s)
        retry = _Backoff(self.backoff_base_s, self.backoff_max_s)
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._post(self.fetch_url, deadline, data={"uuid": uuid, "type": name})
            except httpx.TransportError as err:
                reason, delay = f"{type(err).__name__}: {err}", retry.next()
            else:
                code = response.status_code
                if code == 200:
                    return self._scores(response, uuid, name, key)
                if code == 401:
                    raise PermissionError(
                        f"the reward service at {self.fetch_url} refused the token (401)"
                    )
                if code == 422:
                    log.warning(
                        "reward %s of %s: the service gave up: %s", name, uuid, _message(response)
                    )
                    return None
                if code == 400:  # not scored yet
                    reason, delay = "not ready", poll.next()
                elif code == 429 or code >= 500:
                    reason = f"HTTP {code}: {_message(response)}"
                    delay = max(retry.next(), _retry_after(response))
                else:
                    log.error(
                        "reward %s of %s: unexpected HTTP %d: %s",
                        name,
                        uuid,
                        code,
                        _message(response),
                    )
                    return None
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "reward %s of %s: gave up at the deadline after %d polls (%s)",
                    name,
                    uuid,
                    attempt,
                    reason,
                )
                return None
            if reason != "not ready":
                log.info("reward %s of %s: %s; retrying", name, uuid, reason)
            time.sleep(min(left, delay))

    @staticmethod
    def _scores(response: httpx.Response, uuid: str, name: str, key: str) -> list[float] | None:
        """The scores under `key` (`a+b`: summed) of a pull's answer; None when malformed."""
        try:
            answer = response.json()["scores"]
            parts = [[float(s) for s in answer[k]] for k in key.split("+") if k in answer]
            known = list(answer)
        except (ValueError, KeyError, TypeError) as err:
            log.error("reward %s of %s: malformed answer (%s): %s", name, uuid, err, response.text)
            return None
        missing = [k for k in key.split("+") if k not in known]
        if missing:
            raise ValueError(
                f"reward {name}: the service's scores have no {missing[0]!r} (score_key "
                f"{key!r}); it gives {', '.join(map(repr, known))}"
            )
        if len({len(part) for part in parts}) != 1:
            log.error("reward %s of %s: scores of unequal lengths: %s", name, uuid, response.text)
            return None
        return [sum(values) for values in zip(*parts, strict=True)]

    def score(
        self,
        samples: Tensor | np.ndarray,
        prompts: Sequence[str],
        weights: Mapping[str, float],
        *,
        media_type: str = "latent",
        video_infos: Sequence[Mapping[str, Any]] | None = None,
        deadline_s: float | None = None,
    ) -> list[float] | None:
        """The weighted sum of the rewards in `weights` for each sample (enqueue, then pull);
        None when the service could not be reached, failed, or `deadline_s` (the client's by
        default, for both steps together) passed. A weight <= 0 leaves its reward out."""
        active = {name: float(w) for name, w in weights.items() if w > 0}
        if not active:
            raise ValueError("weights: give at least one reward a weight > 0")
        deadline = time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)
        try:
            uuid = self.enqueue(
                samples,
                prompts,
                active,
                media_type,
                video_infos,
                deadline_s=deadline - time.monotonic(),
            )
        except RemoteRewardError as err:
            log.warning("rewards not scored: %s", err)
            return None
        scores = self.pull(uuid, list(active), deadline_s=max(0.0, deadline - time.monotonic()))
        if scores is None:
            return None
        if any(len(values) != len(prompts) for values in scores.values()):
            log.error("reward service answered %s with the wrong number of scores", uuid)
            return None
        return [sum(w * scores[name][i] for name, w in active.items()) for i in range(len(prompts))]

    def _ping_url(self) -> str:
        # (cosmos-rl's and this service's ping lives beside the enqueue path)
        return self.enqueue_url.rsplit("/", 1)[0] + "/ping"

    def ping(self) -> dict[str, Any]:
        """The service's `/api/reward/ping` answer (status, pending tasks, workers); raises
        `httpx.HTTPError` when it does not answer 200."""
        response = self._http.post(self._ping_url(), data={"info_data": "{}"})
        response.raise_for_status()
        return dict(response.json())

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Return once the service answers a ping (with this client's token) and has a worker;
        `RemoteRewardError` after `timeout_s`, `PermissionError` if the token is refused."""
        deadline = time.monotonic() + timeout_s
        reason = "no answer"
        while True:
            try:
                response = self._post(self._ping_url(), deadline, data={"info_data": "{}"})
            except httpx.TransportError as err:
                reason = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 401:
                    raise PermissionError(
                        f"the reward service at {self._ping_url()} refused the token (401)"
                    )
                if response.status_code == 200:
                    answer = response.json()
                    # (cosmos-rl's ping reports no workers; its answer alone means ready)
                    if not isinstance(answer, dict) or answer.get("workers", 1) > 0:
                        return
                    reason = "no scoring worker yet"
                else:
                    reason = f"HTTP {response.status_code}: {_message(response)}"
            if time.monotonic() >= deadline:
                raise RemoteRewardError(
                    f"the reward service at {self._ping_url()} was not ready in {timeout_s:.0f} s "
                    f"({reason})"
                )
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
