"""The world-model reward service and its client, served for real: a uvicorn server on a free
port in a thread of this process (a subprocess for the CLI), spawned worker processes, real HTTP
with httpx. `reward_helpers:probe` is brightness with a sleep, a failure or a NaN on request."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from nebula_rl.cli import main
from nebula_rl.config import ConfigError
from nebula_rl.rewards.remote import RemoteRewardClient
from nebula_rl.rewards.service import (
    TOKEN_ENV,
    RunningService,
    bind_socket,
    load_service_config,
    resolve_token,
    service_config_from_dict,
    start_service,
)
from nebula_rl.rewards.visual import (
    brightness,
    colour_match,
    pixels_from_samples,
    prompt_alignment,
)
from nebula_rl.utils.net import free_port
from reward_helpers import CRASH_ENV, RECORD_ENV

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROBE = "reward_helpers:probe"
ALIGN = "reward_helpers:video_align"
BUILTIN = ["brightness", "colour_match", "jpeg_compressibility", "prompt_alignment"]


def _config(*rewards: str, **settings: Any) -> Any:
    return service_config_from_dict(
        {"port": 0, "reward_args": [{"reward_type": r} for r in rewards], **settings},
        source="test",
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie is dead, just not reaped
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _stop_and_check(svc: RunningService) -> None:
    """Stop `svc`; its workers and threads must be gone."""
    pids = [p for p in svc.service.stats()["worker_pids"] if p]
    threads = [svc.http.thread, svc.service._supervisor]
    svc.stop()
    deadline = time.monotonic() + 5
    while any(t is not None and t.is_alive() for t in threads) or any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, "the service left a thread or a worker behind"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def svc() -> Iterator[RunningService]:
    """Every built-in reward and the probe, two workers."""
    running = start_service(_config(*BUILTIN, PROBE, ALIGN, num_workers=2), token=TOKEN)
    yield running
    _stop_and_check(running)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningService, Path]]:
    """One worker, at most 3 pending tasks, batches of at most 8 samples; the probe records
    its batch sizes in the returned file."""
    record = tmp_path_factory.mktemp("small") / "batches.txt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RECORD_ENV, str(record))  # read by the workers when they start
        running = start_service(
            _config("brightness", PROBE, max_pending=3, max_batch_samples=8), token=TOKEN
        )
    yield running, record
    _stop_and_check(running)


@pytest.fixture
def http(svc: RunningService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=svc.url, headers=AUTH, timeout=10) as client:
        yield client


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _body(array: np.ndarray, prompts: list[str], rewards: dict[str, float], **header: Any) -> bytes:
    head = {"prompts": prompts, "reward_fn": rewards, **header}
    return json.dumps(head).encode() + b"\n" + _npy(array)


def _enqueue(client: httpx.Client, *args: Any, **header: Any) -> str:
    response = client.post("/api/reward/enqueue", content=_body(*args, **header))
    assert response.status_code == 200, response.text
    return str(response.json()["uuid"])


def _pull(client: httpx.Client, uuid: str, name: str, timeout: float = 20.0) -> httpx.Response:
    """The first answer that is not 400 ("not ready")."""
    deadline = time.monotonic() + timeout
    while True:
        response = client.post("/api/reward/pull", data={"uuid": uuid, "type": name})
        if response.status_code != 400 or time.monotonic() > deadline:
            return response
        assert response.json() == {"message": f"Not found scores for {uuid}"}
        time.sleep(0.02)


def _wait(client: httpx.Client, ready: Any, timeout: float = 20.0) -> dict[str, Any]:
    """Ping until `ready(answer)`; the answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer = client.post("/api/reward/ping").json()
        if ready(answer):
            return dict(answer)
        assert time.monotonic() < deadline, answer
        time.sleep(0.02)


def _idle(client: httpx.Client) -> dict[str, Any]:
    return _wait(client, lambda a: a["pending"] == 0 and a["running"] == 0)


def _latents() -> tuple[torch.Tensor, list[str]]:
    """4 samples [4, 3, 1, 8, 8] in [-1, 1]: flat grey levels and a red, a green frame."""
    x = torch.tensor([-1.0, -0.5, 0.5, 1.0]).view(4, 1, 1, 1, 1).expand(4, 3, 1, 8, 8).clone()
    x[2, 0], x[2, 1:] = 1.0, -1.0  # red
    x[3, 1], x[3, [0, 2]] = 1.0, -1.0  # green
    return x, ["a grey square", "a dark circle", "a red square", "a red bar"]


# ---------------------------------------------------------------------------------------------
# protocol


def test_latent_round_trip_scores_equal_the_functions(http: httpx.Client) -> None:
    x, prompts = _latents()
    infos = [{"video_fps": 16.0}] * 4
    uuid = _enqueue(
        http, x.numpy(), prompts, {"brightness": 1.0, "colour_match": 0.5}, video_infos=infos
    )
    pixels = pixels_from_samples(x)
    for name, fn in (("brightness", brightness), ("colour_match", colour_match)):
        response = _pull(http, uuid, name)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["scores"] == {name: fn(pixels, prompts)}  # unweighted, per name
        assert answer["type"] == name and answer["duration"] >= 0
        assert answer["input_info"] == {
            "shape": [4, 3, 1, 8, 8],
            "dtype": "torch.float32",
            "min": -1.0,
            "max": 1.0,
            "video_infos": infos,
        }
        assert _pull(http, uuid, name).json() == answer  # pulled again: the same answer
    assert brightness(pixels, prompts)[:2] == [0.0, pytest.approx(64 / 255)]
    assert colour_match(pixels, prompts)[2:] == [1.0, -0.5]  # green frame: 0 - (1 + 0) / 2

    # cosmos-rl's form: bfloat16 samples sent as their bytes (uint8, last axis doubled)
    bf16 = (x * 0.7).to(torch.bfloat16)
    uuid = _enqueue(http, bf16.view(torch.uint8).numpy(), prompts, {"prompt_alignment": 1.0})
    answer = _pull(http, uuid, "prompt_alignment").json()
    assert answer["scores"]["prompt_alignment"] == prompt_alignment(
        pixels_from_samples(bf16), prompts
    )
    assert answer["input_info"]["shape"] == [4, 3, 1, 8, 8]
    assert answer["input_info"]["dtype"] == "torch.bfloat16"
    assert answer["input_info"]["video_infos"] == []


def test_video_and_image_media_types(http: httpx.Client) -> None:
    rng = np.random.default_rng(0)
    video = rng.integers(0, 256, size=(2, 3, 3, 8, 8), dtype=np.uint8)
    expected = brightness(torch.from_numpy(video), ["a", "b"])
    uuid = _enqueue(http, video, ["a", "b"], {"brightness": 1}, media_type="video")
    answer = _pull(http, uuid, "brightness").json()
    assert answer["scores"]["brightness"] == expected
    assert answer["input_info"]["dtype"] == "torch.uint8"
    # values 0..255 as floats are the same video
    uuid = _enqueue(
        http, video.astype(np.float32), ["a", "b"], {"brightness": 1}, media_type="video"
    )
    assert _pull(http, uuid, "brightness").json()["scores"]["brightness"] == expected

    images = rng.integers(0, 256, size=(3, 8, 8, 3), dtype=np.uint8)  # [B, H, W, C]
    prompts = ["red", "green", "blue"]
    as_video = torch.from_numpy(images).permute(0, 3, 1, 2).unsqueeze(2)
    uuid = _enqueue(http, images, prompts, {"colour_match": 2.0}, media_type="image")
    answer = _pull(http, uuid, "colour_match").json()
    assert answer["scores"]["colour_match"] == colour_match(as_video, prompts)
    assert answer["input_info"]["shape"] == [3, 8, 8, 3]


def test_pull_of_unknown_uuid_or_unasked_reward(http: httpx.Client) -> None:
    response = http.post("/api/reward/pull", data={"uuid": "nope", "type": "brightness"})
    assert response.status_code == 400
    assert response.json() == {"message": "Not found scores for nope"}
    x, prompts = _latents()
    uuid = _enqueue(http, x.numpy(), prompts, {"brightness": 1.0, "colour_match": 0.0})
    assert _pull(http, uuid, "brightness").status_code == 200
    response = _pull(http, uuid, "colour_match")  # weight 0: not scored
    assert response.status_code == 422 and "was not asked" in response.json()["message"]
    response = http.post("/api/reward/pull", data={"uuid": uuid})  # one reward: type optional
    assert response.status_code == 200 and response.json()["type"] == "brightness"


def test_every_endpoint_but_health_needs_the_token(svc: RunningService) -> None:
    x, prompts = _latents()
    body = _body(x.numpy(), prompts, {"brightness": 1.0})
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}]
    with httpx.Client(base_url=svc.url, timeout=10) as client:
        for headers in wrong:
            for path, kwargs in (
                ("/api/reward/enqueue", {"content": body}),
                ("/api/reward/pull", {"data": {"uuid": "x", "type": "brightness"}}),
                ("/api/reward/ping", {"data": {"info_data": "{}"}}),
            ):
                response = client.post(path, headers=headers, **kwargs)
                assert response.status_code == 401, (path, headers)
                assert response.headers["www-authenticate"] == "Bearer"
        assert client.get("/health").json() == {"status": "ok"}
        ping = client.post("/api/reward/ping", headers=AUTH, data={"info_data": "{}"}).json()
    assert ping["status"] == "ok" and ping["workers"] == 2 and ping["pending"] >= 0


def _bad_bodies() -> list[tuple[str, bytes, str]]:
    x, prompts = _latents()
    good = x.numpy()
    head = json.dumps({"prompts": prompts, "reward_fn": {"brightness": 1.0}}).encode()
    with_nan = good.copy()
    with_nan[0, 0, 0, 0, 0] = np.nan
    return [
        ("no newline", b"just some bytes", "no newline"),
        ("bad JSON", b"{not json\n" + _npy(good), "JSON before the first newline is invalid"),
        ("JSON not an object", b"[1, 2]\n" + _npy(good), "must be an object"),
        ("NaN in JSON", b'{"prompts": [NaN]}\n' + _npy(good), "NaN"),
        ("not npy", head + b"\nthese are not npy bytes", "not an .npy array"),
        (
            "huge number",
            head[:-1] + b', "video_infos": [{"fps": 1e400}]}\n' + _npy(good),
            "`video_infos` holds a number",
        ),
        (
            "truncated npy",
            head + b"\n" + _npy(good)[:-10],
            "describes 3072 bytes of data (float32 [4, 3, 1, 8, 8]) but 3062",
        ),
        ("objects", head + b"\n" + _npy(np.array([{}], dtype=object)), "Python objects"),
        ("mismatch", _body(good[:3], prompts, {"brightness": 1.0}), "3 samples but 4 prompts"),
        ("unknown reward", _body(good, prompts, {"nope": 1.0}), "unknown reward(s) 'nope'"),
        ("no weight", _body(good, prompts, {"brightness": 0.0}), "weight > 0"),
        ("prompts", _body(good, [1, 2, 3, 4], {"brightness": 1}), "`prompts` must be"),  # type: ignore[list-item]
        ("media type", _body(good, prompts, {"brightness": 1}, media_type="audio"), "media_type"),
        ("shape", _body(good[:, 0], prompts, {"brightness": 1}), "expected latent samples"),
        ("NaN samples", _body(with_nan, prompts, {"brightness": 1}), "NaN or infinite"),
        ("empty", _body(good[:0], [], {"brightness": 1}), "empty"),
        (
            "video range",
            _body(good * 300, prompts, {"brightness": 1}, media_type="video"),
            "0..255",
        ),
        (
            "image layout",
            _body(good[:, :, 0], prompts, {"brightness": 1}, media_type="image"),
            "images [B, H, W, C=3]",
        ),
        (
            "odd bfloat16 bytes",
            _body(np.zeros((4, 3, 1, 8, 7), np.uint8), prompts, {"brightness": 1}),
            "must be even",
        ),
        (
            "integer latents",
            _body(np.zeros((4, 3, 1, 8, 8), np.int32), prompts, {"brightness": 1}),
            "must be floats",
        ),
    ]


def test_bad_bodies_get_4xx_naming_the_problem(http: httpx.Client) -> None:
    for what, body, message in _bad_bodies():
        response = http.post("/api/reward/enqueue", content=body)
        assert 400 <= response.status_code < 500, (what, response.status_code, response.text)
        assert message in response.json()["message"], (what, response.json())
    response = http.post("/api/reward/pull", data={"type": "brightness"})
    assert response.status_code == 422 and "`uuid`" in response.json()["message"]
    response = http.post("/api/reward/pull", files={"uuid": ("u", b"x")})
    assert response.status_code == 415 and "url-encoded" in response.json()["message"]
    assert _idle(http)["pending"] == 0  # nothing was queued


def test_a_reward_that_raises_or_returns_nan_is_422(http: httpx.Client) -> None:
    x, _ = _latents()
    uuid = _enqueue(http, x.numpy()[:2], ["fail please", "ok"], {PROBE: 1.0, "brightness": 1.0})
    response = _pull(http, uuid, PROBE)
    assert response.status_code == 422
    assert response.json()["message"] == (
        "scoring failed: ValueError: a prompt asked this reward to fail"
    )
    assert _pull(http, uuid, "brightness").status_code == 200  # the other reward is unaffected
    uuid = _enqueue(http, x.numpy()[:2], ["ok", "nan"], {PROBE: 1.0})
    response = _pull(http, uuid, PROBE)
    assert response.status_code == 422 and "non-finite score for sample(s) [1]" in response.text


def test_scores_arrive_out_of_order(http: httpx.Client) -> None:
    _idle(http)  # both workers free
    x, _ = _latents()
    slow = _enqueue(http, x.numpy()[:1], ["sleep=1.5"], {PROBE: 1.0})
    fast = _enqueue(http, x.numpy()[1:2], ["now"], {PROBE: 1.0})
    start = time.monotonic()
    assert _pull(http, fast, PROBE).status_code == 200
    assert time.monotonic() - start < 1.2  # did not wait for the slow one
    response = http.post("/api/reward/pull", data={"uuid": slow, "type": PROBE})
    assert response.status_code == 400
    assert response.json() == {"message": f"Not found scores for {slow}"}
    response = _pull(http, slow, PROBE)
    assert response.status_code == 200
    assert response.json()["scores"][PROBE] == brightness(pixels_from_samples(x[:1]), ["x"])


# ---------------------------------------------------------------------------------------------
# queue, batching, workers


def test_a_full_queue_answers_429_then_drains(small: tuple[RunningService, Path]) -> None:
    svc, _ = small
    x, _ = _latents()
    with httpx.Client(base_url=svc.url, headers=AUTH, timeout=10) as http:
        held = [_enqueue(http, x.numpy()[:1], ["sleep=0.8"], {PROBE: 1.0})]
        _wait(http, lambda a: a["running"] == 1)
        held += [_enqueue(http, x.numpy()[:1], ["b"], {"brightness": 1.0}) for _ in range(2)]
        response = http.post("/api/reward/enqueue", content=_body(x.numpy(), ["c"] * 4, {PROBE: 1}))
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert "max_pending = 3" in response.json()["message"]
        for uuid in held:
            assert _pull(http, uuid, PROBE if uuid == held[0] else "brightness").status_code == 200
        uuid = _enqueue(http, x.numpy(), ["c"] * 4, {PROBE: 1.0})  # drained: taken again
        assert _pull(http, uuid, PROBE).status_code == 200


def test_queued_requests_are_batched_into_one_call(small: tuple[RunningService, Path]) -> None:
    svc, record = small
    x, _ = _latents()
    with httpx.Client(base_url=svc.url, headers=AUTH, timeout=10) as http:
        _idle(http)
        record.write_text("")
        first = _enqueue(http, x.numpy()[:1], ["sleep=0.8"], {PROBE: 1.0})
        _wait(http, lambda a: a["running"] == 1)
        calls = http.post("/api/reward/ping").json()["calls"][PROBE]
        # two tasks of 2 samples queue up behind it; one of them makes the reward raise
        bad = _enqueue(http, x.numpy()[:2], ["fail", "x"], {PROBE: 1.0})
        good = _enqueue(http, x.numpy()[2:], ["x", "y"], {PROBE: 1.0})
        for uuid in (first, good):
            assert _pull(http, uuid, PROBE).status_code == 200
        assert _pull(http, good, PROBE).json()["scores"][PROBE] == brightness(
            pixels_from_samples(x[2:]), ["x", "y"]
        )
        assert _pull(http, bad, PROBE).status_code == 422  # only the task that raised fails
        assert http.post("/api/reward/ping").json()["calls"][PROBE] == calls + 1
    # one call of 1, one of 2 + 2 (which raised), then each task alone to find the culprit
    assert record.read_text().split() == ["1", "4", "2", "2"]


def test_client_retries_429_until_the_queue_has_room(
    small: tuple[RunningService, Path], caplog: pytest.LogCaptureFixture
) -> None:
    svc, _ = small
    x, _ = _latents()
    with httpx.Client(base_url=svc.url, headers=AUTH, timeout=10) as http:
        _idle(http)
        _enqueue(http, x.numpy()[:1], ["sleep=0.6"], {PROBE: 1.0})
        _enqueue(http, x.numpy()[:1], ["a"], {"brightness": 1.0})
        _enqueue(http, x.numpy()[:1], ["b"], {"brightness": 1.0})
    url = f"{svc.url}/api/reward/"
    with (
        RemoteRewardClient(url + "enqueue", url + "pull", TOKEN, deadline_s=20) as client,
        caplog.at_level(logging.INFO, logger="nebula_rl.rewards.remote"),
    ):
        start = time.monotonic()
        scores = client.score(x, ["x"] * 4, {"brightness": 2.0})
    assert scores == pytest.approx([2 * s for s in brightness(pixels_from_samples(x), ["x"] * 4)])
    assert time.monotonic() - start > 0.3
    assert "HTTP 429" in caplog.text and "retrying" in caplog.text


def test_a_killed_worker_s_task_is_retried_then_given_up(caplog: pytest.LogCaptureFixture) -> None:
    svc = start_service(_config("brightness", PROBE, max_attempts=2), token=TOKEN)
    try:
        x, _ = _latents()
        with httpx.Client(base_url=svc.url, headers=AUTH, timeout=10) as http:
            uuid = _enqueue(http, x.numpy()[:2], ["sleep=0.8", "a"], {PROBE: 1.0})
            (pid,) = _wait(http, lambda a: a["running"] == 1)["worker_pids"]
            os.kill(pid, signal.SIGKILL)
            response = _pull(http, uuid, PROBE)  # scored by the replacement worker
            assert response.status_code == 200, response.text
            assert response.json()["scores"][PROBE] == brightness(
                pixels_from_samples(x[:2]), ["a", "b"]
            )
            ping = http.post("/api/reward/ping").json()
            assert ping["workers"] == 1 and ping["worker_pids"] != [pid]
            assert "killed by SIGKILL" in caplog.text and uuid in caplog.text

            # killed on every attempt (max_attempts = 2): the task fails, the service goes on
            uuid = _enqueue(http, x.numpy()[:1], ["sleep=30"], {PROBE: 1.0})
            for _ in range(2):
                ping = _wait(http, lambda a: a["running"] == 1 and a["workers"] == 1)
                os.kill(ping["worker_pids"][0], signal.SIGKILL)
                _wait(http, lambda a, p=ping: a["worker_pids"] != p["worker_pids"])
            response = _pull(http, uuid, PROBE)
            assert response.status_code == 422
            assert "worker died (killed by SIGKILL)" in response.json()["message"]
            assert "gave up after 2 attempts" in response.json()["message"]
            uuid = _enqueue(http, x.numpy()[:1], ["a"], {"brightness": 1.0})
            assert _pull(http, uuid, "brightness").status_code == 200
    finally:
        _stop_and_check(svc)


def test_results_expire_and_no_live_worker_means_503(monkeypatch: pytest.MonkeyPatch) -> None:
    svc = start_service(_config("brightness", PROBE, result_ttl_s=0.5), token=TOKEN)
    try:
        x, _ = _latents()
        with httpx.Client(base_url=svc.url, headers=AUTH, timeout=10) as http:
            uuid = _enqueue(http, x.numpy()[:1], ["a"], {"brightness": 1.0})
            assert _pull(http, uuid, "brightness").status_code == 200
            time.sleep(0.8)  # past result_ttl_s: forgotten
            response = http.post("/api/reward/pull", data={"uuid": uuid, "type": "brightness"})
            assert response.status_code == 400 and "Not found scores" in response.text

            # every replacement of a killed worker dies starting: the slot is given up
            monkeypatch.setenv(CRASH_ENV, "1")
            uuid = _enqueue(http, x.numpy()[:1], ["sleep=30"], {PROBE: 1.0})
            (pid,) = _wait(http, lambda a: a["running"] == 1)["worker_pids"]
            os.kill(pid, signal.SIGKILL)
            response = _pull(http, uuid, PROBE)
            assert response.status_code == 422
            assert (
                "no scoring worker is alive: worker 0 died 3 times before it was ready"
                in (response.json()["message"])
            )
            response = http.post(
                "/api/reward/enqueue", content=_body(x.numpy(), ["a"] * 4, {PROBE: 1})
            )
            assert response.status_code == 503 and "exit code 3" in response.json()["message"]
            assert http.post("/api/reward/ping").json()["workers"] == 0
        with _client(svc, deadline_s=0.5) as client:  # 503 is retried until the deadline
            assert client.score(x, ["a"] * 4, {PROBE: 1.0}) is None
    finally:
        _stop_and_check(svc)


# ---------------------------------------------------------------------------------------------
# client


def test_client_from_env_prefers_remote_names(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TOKEN", "ENQUEUE_URL", "FETCH_URL"):
        monkeypatch.setenv(f"WFM_REWARD_{name}", f"wfm-{name}")
        monkeypatch.delenv(f"REMOTE_REWARD_{name}", raising=False)
    with RemoteRewardClient.from_env() as client:
        assert (client.enqueue_url, client.fetch_url) == ("wfm-ENQUEUE_URL", "wfm-FETCH_URL")
        assert client._http.headers["authorization"] == "Bearer wfm-TOKEN"
    monkeypatch.setenv("REMOTE_REWARD_TOKEN", "remote-token")
    monkeypatch.setenv("REMOTE_REWARD_FETCH_URL", "remote-fetch")
    with RemoteRewardClient.from_env(deadline_s=5) as client:
        assert (client.enqueue_url, client.fetch_url) == ("wfm-ENQUEUE_URL", "remote-fetch")
        assert client._http.headers["authorization"] == "Bearer remote-token"
        assert client.deadline_s == 5
    monkeypatch.delenv("WFM_REWARD_ENQUEUE_URL")
    with pytest.raises(ValueError, match="REMOTE_REWARD_ENQUEUE_URL or WFM_REWARD_ENQUEUE_URL"):
        RemoteRewardClient.from_env()


def _client(svc: RunningService, **kwargs: Any) -> RemoteRewardClient:
    url = f"{svc.url}/api/reward/"
    return RemoteRewardClient(url + "enqueue", url + "pull", TOKEN, **kwargs)


def test_client_scores_weighted_and_takes_each_uuid_once(svc: RunningService) -> None:
    x, prompts = _latents()
    pixels = pixels_from_samples(x)
    with _client(svc, deadline_s=20) as client:
        scores = client.score(x, prompts, {"brightness": 1.0, "colour_match": 0.5, "nope": 0})
        expected = [
            b + 0.5 * c
            for b, c in zip(brightness(pixels, prompts), colour_match(pixels, prompts), strict=True)
        ]
        assert scores == pytest.approx(expected)
        uuid = client.enqueue(x.to(torch.bfloat16), prompts, {"brightness": 1.0})
        result = client.pull(uuid, ["brightness"])
        assert result == {
            "brightness": brightness(pixels_from_samples(x.to(torch.bfloat16)), prompts)
        }
        with pytest.raises(ValueError, match="pulled already"):
            client.pull(uuid, ["brightness"])
        with pytest.raises(ValueError, match="unknown reward"):
            client.enqueue(x, prompts, {"nope": 1.0})
        with pytest.raises(PermissionError):
            RemoteRewardClient(client.enqueue_url, client.fetch_url, "wrong").enqueue(
                x, prompts, {"brightness": 1.0}
            )


def test_a_reward_of_several_scores_is_pulled_by_score_key(
    http: httpx.Client, svc: RunningService
) -> None:
    """A reward that returns several named scores per sample (as cosmos-rl's `dance_grpo` does)
    answers all of them; the client takes the one `score_keys` names, `a+b` summed, and names
    the keys there are when asked for another."""
    x, prompts = _latents()
    pixels = pixels_from_samples(x)
    quality, alignment = brightness(pixels, prompts), colour_match(pixels, prompts)
    uuid = _enqueue(http, x.numpy(), prompts, {ALIGN: 1.0})
    answer = _pull(http, uuid, ALIGN).json()
    assert answer["scores"] == {
        "overall_reward": pytest.approx([q + a for q, a in zip(quality, alignment, strict=True)]),
        "vq_reward": pytest.approx(quality),
        "ta_reward": pytest.approx(alignment),
    }
    with _client(svc, deadline_s=20) as client:
        for key, want in (
            ("overall_reward", [q + a for q, a in zip(quality, alignment, strict=True)]),
            ("vq_reward", quality),
            ("ta_reward+vq_reward", [q + a for q, a in zip(quality, alignment, strict=True)]),
        ):
            uuid = client.enqueue(x, prompts, {ALIGN: 1.0})
            got = client.pull(uuid, [ALIGN], score_keys={ALIGN: key})
            assert got == {ALIGN: pytest.approx(want)}, key
        uuid = client.enqueue(x, prompts, {ALIGN: 1.0})
        with pytest.raises(ValueError, match=r"no 'mq_reward' \(score_key 'mq_reward'\); it gives"):
            client.pull(uuid, [ALIGN], score_keys={ALIGN: "mq_reward"})


def test_client_polls_until_ready_and_gives_up_at_the_deadline(svc: RunningService) -> None:
    x, _ = _latents()
    with _client(svc, deadline_s=20) as client:
        start = time.monotonic()
        uuid = client.enqueue(x[:1], ["sleep=0.6"], {PROBE: 1.0})
        assert client.pull(uuid, [PROBE]) is not None  # polled through "not ready" (400)
        assert time.monotonic() - start >= 0.6
        start = time.monotonic()
        assert client.score(x[:1], ["sleep=1.5"], {PROBE: 1.0}, deadline_s=0.5) is None
        assert time.monotonic() - start < 0.5 + 0.7
        uuid = client.enqueue(x[:1], ["fail"], {PROBE: 1.0})
        assert client.pull(uuid, [PROBE]) is None  # scoring failed: 422, not a stall
    with httpx.Client(base_url=svc.url, headers=AUTH, timeout=10) as http:
        _idle(http)  # leave both workers free


def test_client_gives_up_on_an_unreachable_service() -> None:
    url = f"http://127.0.0.1:{free_port()}/api/reward/"
    with RemoteRewardClient(url + "enqueue", url + "pull", TOKEN, deadline_s=0.6) as client:
        start = time.monotonic()
        assert client.score(torch.zeros(1, 3, 1, 4, 4), ["x"], {"brightness": 1.0}) is None
        assert 0.5 < time.monotonic() - start < 1.5


# ---------------------------------------------------------------------------------------------
# config, token, port, CLI


def test_shipped_config_loads() -> None:
    cfg = load_service_config(ROOT / "configs" / "rewards.toml")
    assert cfg.rewards == BUILTIN
    assert (cfg.host, cfg.port, cfg.max_pending, cfg.num_workers) == ("127.0.0.1", 8080, 64, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'redis_host = "redis.example"',
            "redis_host: 'redis.example': results are kept in the "
            "service's memory; a Redis store is not supported yet",
        ),
        ("redis_port = 6380", "redis_port: 6380: results are kept in the service's memory"),
        (
            '[[reward_args]]\nreward_type = "brightness"\nmodel_path = "m/x"',
            "reward_args[0].model_path: 'm/x': only a model-based reward (reasoner_judge) loads",
        ),
        (
            '[[reward_args]]\nreward_type = "reasoner_judge"',
            "reward_args[0]: reasoner_judge needs model_path",
        ),
        (
            '[[reward_args]]\nreward_type = "reasoner_judge"\nmodel_path = "m/x"\ndtype = "int8"',
            "reward_args[0].dtype: 'int8': one of bfloat16, float16, float32",
        ),
        (
            '[[reward_args]]\nreward_type = "brightness"\nvenv_python = "/v/bin/python"',
            "reward_args[0].venv_python: '/v/bin/python': per-reward virtualenvs",
        ),
        ('colour = "red"', "colour: unknown key"),
        (
            '[[reward_args]]\nreward_type = "brightness"\nmodle_path = ""',
            "reward_args[0].modle_path: unknown key",
        ),
        (
            '[[reward_args]]\nreward_type = "brightness"\n[[reward_args]]\nreward_type = "aesthetic"',
            "reward_args[1].reward_type: unknown reward 'aesthetic': one of brightness, colour_match, "
            "jpeg_compressibility, prompt_alignment",
        ),
        (
            '[[reward_args]]\nreward_type = "no_such_module:fn"',
            "reward_args[0].reward_type: cannot import reward 'no_such_module:fn'",
        ),
        (
            '[[reward_args]]\nreward_type = "brightness"\nenable = false',
            "reward_args: enable at least one reward",
        ),
        ("max_pending = 0", "max_pending: Input should be greater than or equal to 1"),
    ],
)
def test_config_errors_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rewards.toml"
    rewards = (
        '\n[[reward_args]]\nreward_type = "colour_match"\n' if "reward_args" not in text else ""
    )
    path.write_text(text + "\n" + rewards)
    with pytest.raises(ConfigError) as err:
        load_service_config(path)
    assert f"{path}: {message}" in str(err.value)


def test_cosmos_rl_defaults_load() -> None:
    cfg = service_config_from_dict(
        {
            "host": "localhost",
            "redis_host": "localhost",
            "redis_port": 6379,
            "reward_args": [
                {"reward_type": "brightness", "venv_python": "python", "device": "cpu"},
                {"reward_type": "colour_match", "enable": False, "model_path": ""},
            ],
        }
    )
    assert cfg.rewards == ["brightness"]


def test_token_from_env_config_or_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert resolve_token(_config("brightness", token="from-config")) == "from-env"
    monkeypatch.delenv(TOKEN_ENV)
    assert resolve_token(_config("brightness", token="from-config")) == "from-config"
    path = tmp_path / "sub" / "svc.token"
    with caplog.at_level(logging.INFO, logger="nebula_rl.rewards.service"):
        token = resolve_token(_config("brightness", token_file=str(path)))
    assert len(token) >= 40 and path.read_text().strip() == token
    assert path.stat().st_mode & 0o777 == 0o600
    assert str(path) in caplog.text and token not in caplog.text


def test_a_port_in_use_is_an_error_not_another_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}.*`port`"):
            start_service(_config("brightness", port=port), token=TOKEN)
        with pytest.raises(ValueError, match="does not move to another port"):
            bind_socket("127.0.0.1", port)


def test_cli_refuses_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rewards.toml"
    path.write_text('redis_port = 1\n[[reward_args]]\nreward_type = "brightness"\n')
    assert main(["reward-service", "--config", str(path)]) == 2
    assert f"{path}: redis_port: 1: results are kept" in capsys.readouterr().err


def test_cli_serves_until_sigterm_then_stops_its_workers(tmp_path: Path) -> None:
    config = tmp_path / "rewards.toml"
    config.write_text('port = 1\n[[reward_args]]\nreward_type = "brightness"\n')
    port = free_port()
    env = {**os.environ, TOKEN_ENV: TOKEN, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "nebula_rl.cli", "reward-service", "--config", str(config)]
    process = subprocess.Popen(
        [*command, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        base = f"{url}/api/reward/"
        with RemoteRewardClient(base + "enqueue", base + "pull", TOKEN) as client:
            client.wait_ready(timeout_s=60)
        assert process.poll() is None
        x, prompts = _latents()
        with httpx.Client(base_url=url, headers=AUTH, timeout=10) as http:
            uuid = _enqueue(http, x.numpy(), prompts, {"brightness": 1.0})
            assert _pull(http, uuid, "brightness").status_code == 200
            pids = http.post("/api/reward/ping").json()["worker_pids"]
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output
    assert "reward service stopped" in output
    assert pids and not any(_alive(p) for p in pids)


def test_a_reasoner_judges_clips_and_images_through_the_service() -> None:
    """`reasoner_judge` with `model_path` (here Cosmos 3's tiny reasoner preset): the worker
    loads the model once and scores each sample by the probability of "yes" against "no" to
    whether it shows its prompt; the service's scores for a clip batch and an image batch equal
    the judge's own in this process, and a sample's score does not depend on its batch."""
    from nebula_rl.rewards.judge import ReasonerJudge

    config = service_config_from_dict(
        {
            "port": 0,
            "reward_args": [{"reward_type": "reasoner_judge", "model_path": "tiny:cosmos3_omni"}],
        },
        source="test",
    )
    judge = ReasonerJudge("tiny:cosmos3_omni")
    g = torch.Generator().manual_seed(3)
    clips = torch.rand(3, 3, 2, 32, 32, generator=g) * 2 - 1  # (samples in [-1, 1])
    prompts = ["a red square", "a blue circle", "a green bar"]
    want = judge(pixels_from_samples(clips), prompts)
    assert all(0.0 < w < 1.0 for w in want) and len(set(want)) == 3
    assert judge(pixels_from_samples(clips[1:2]), prompts[1:2]) == want[1:2]
    images = clips[:, :, :1]
    running = start_service(config, token=TOKEN)
    try:
        with httpx.Client(base_url=running.url, headers=AUTH, timeout=10) as client:
            for x, expected in ((clips, want), (images, None)):
                uuid = _enqueue(client, x.numpy(), prompts, {"reasoner_judge": 1.0})
                response = _pull(client, uuid, "reasoner_judge", timeout=120.0)
                assert response.status_code == 200, response.text
                scores = response.json()["scores"]["reasoner_judge"]
                if expected is None:
                    expected = judge(pixels_from_samples(x), prompts)
                assert scores == pytest.approx(expected, abs=1e-6)
    finally:
        _stop_and_check(running)
