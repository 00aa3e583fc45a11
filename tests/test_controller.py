"""Controller: a real private Redis, a real uvicorn server, the exactly-once ledger, restarts."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nebula_rl.controller import JobState, RedisServer, connect, create_app, serve, start_redis
from nebula_rl.protocol import Completion, Prompt, RolloutGroup

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json"}
REGISTER = {"name": "rollout-0", "role": "rollout", "host": "node-1", "world_size": 2}
HEARTBEAT = {"name": "rollout-0", "policy_version": 3, "stats": {"tokens_per_s": 12.5}}


@pytest.fixture
def state(redis_server: RedisServer) -> JobState:
    return JobState(connect(redis_server.url), "job-1")


@pytest.fixture
def client(state: JobState) -> Iterator[httpx.Client]:
    """A client without credentials against a real uvicorn server; pass `headers=AUTH`."""
    app = create_app(
        state=state,
        config_json={"train": {"epoch": 1}},
        token=TOKEN,
        meta_extra={"redis_url": "redis://:secret@127.0.0.1:1/0"},
    )
    with serve(app) as server, httpx.Client(base_url=server.url, timeout=10.0) as c:
        assert server.host == "127.0.0.1" and server.port > 0
        yield c


def _prompts(n: int, epoch: int = 0) -> list[Prompt]:
    return [Prompt(f"{epoch}:{i}", epoch, i, f"what is {i}+1?", str(i + 1)) for i in range(n)]


def _group(prompt: Prompt, version: int, replica: str = "rollout-0") -> RolloutGroup:
    completion = Completion([1, 2], [-0.1, -0.2], "ab", "stop", [(0, version)], reward=1.0)
    return RolloutGroup(prompt, [7, 8], [completion, completion], replica=replica)


# -- Redis server ---------------------------------------------------------------------------------


def test_redis_is_private_and_stops(redis_server: RedisServer) -> None:
    client = connect(redis_server.url)
    assert client.ping()
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    assert client.config_get("protected-mode")["protected-mode"] == "yes"
    assert client.config_get("appendonly")["appendonly"] == "yes"
    assert len(redis_server.password) >= 32
    # Raw RESP over a socket: redis-py would retry refused logins with backoff for seconds.
    with socket.create_connection((redis_server.host, redis_server.port), timeout=5.0) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(256).startswith(b"-NOAUTH")
        sock.sendall(b"AUTH wrong\r\n")
        assert sock.recv(256).startswith(b"-WRONGPASS")
        sock.sendall(f"AUTH {redis_server.password}\r\n".encode())
        assert sock.recv(256) == b"+OK\r\n"
    redis_server.stop()
    assert redis_server.process.poll() is not None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((redis_server.host, redis_server.port), timeout=5.0)


# -- HTTP API -------------------------------------------------------------------------------------


def test_health_is_public_and_everything_else_needs_the_token(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    wrong = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {TOKEN}x"},
    ]
    for headers in wrong:
        assert (
            client.post("/api/replica/register", json=REGISTER, headers=headers).status_code == 401
        )
        assert (
            client.post("/api/replica/heartbeat", json=HEARTBEAT, headers=headers).status_code
            == 401
        )
        meta = client.get("/api/meta", headers=headers)
        assert meta.status_code == 401 and "secret" not in meta.text
        assert client.get("/api/status", headers=headers).status_code == 401
    # The token is checked before the body is parsed: no validation details for strangers.
    bad = client.post("/api/replica/register", content=b"{not json", headers=JSON)
    assert bad.status_code == 401
    meta = client.get("/api/meta", headers=AUTH).json()
    assert meta["config"] == {"train": {"epoch": 1}}
    assert meta["redis_url"].startswith("redis://")
    assert client.get("/api/status", headers=AUTH).json()["replicas"] == {}


def test_replica_register_heartbeat_unregister(client: httpx.Client, state: JobState) -> None:
    reply = client.post("/api/replica/register", json=REGISTER, headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"replica_id": 1, "policy_version": 0, "step": 0}
    state.bump_policy_version()
    reply = client.post("/api/replica/heartbeat", json=HEARTBEAT, headers=AUTH)
    assert reply.json() == {"policy_version": 1, "step": 0, "finished": None}
    replica = client.get("/api/status", headers=AUTH).json()["replicas"]["rollout-0"]
    assert replica["role"] == "rollout" and replica["world_size"] == 2
    assert replica["policy_version"] == 3 and replica["stats"] == {"tokens_per_s": 12.5}

    # A rollout that rejoins under its old name gives back the prompts it held.
    state.enqueue_prompts(_prompts(4))
    assert len(state.claim_prompts("rollout-0", 3)) == 3
    assert (
        client.post("/api/replica/register", json=REGISTER, headers=AUTH).json()["replica_id"] == 2
    )
    assert state.ledger_summary(0)["requeued"] == 3

    unknown = {**HEARTBEAT, "name": "nobody"}
    assert client.post("/api/replica/heartbeat", json=unknown, headers=AUTH).status_code == 404
    gone = {"name": "rollout-0"}
    assert client.post("/api/replica/unregister", json=gone, headers=AUTH).json() == {"ok": True}
    assert client.post("/api/replica/unregister", json=gone, headers=AUTH).status_code == 404
    assert client.post("/api/replica/heartbeat", json=HEARTBEAT, headers=AUTH).status_code == 404
    status = client.get("/api/status", headers=AUTH).json()
    assert status["replicas"] == {} and status["policy_version"] == 1
    assert status["ledger"]["0"]["total"] == 4


def test_malformed_bodies_get_4xx(client: httpx.Client) -> None:
    register = "/api/replica/register"
    # Registered, so a heartbeat body is refused for its content and not for an unknown name.
    assert client.post(register, json=REGISTER, headers=AUTH).status_code == 200
    cases: list[tuple[str, bytes]] = [
        (register, b"{not json"),
        (register, b""),
        (register, b"null"),
        (register, b"[]"),
        (register, b'"rollout"'),
        (register, b"\xff\xfe\x00"),
        (register, b"[" * 200_000),
        (register, json.dumps({**REGISTER, "admin": True}).encode()),
        (register, json.dumps({**REGISTER, "role": "admin"}).encode()),
        (register, json.dumps({**REGISTER, "world_size": "2"}).encode()),
        (register, json.dumps({**REGISTER, "world_size": 2.0}).encode()),
        (register, json.dumps({**REGISTER, "world_size": 0}).encode()),
        (register, json.dumps({**REGISTER, "world_size": 10**30}).encode()),
        (register, json.dumps({**REGISTER, "name": "a" * 500_000}).encode()),
        (register, json.dumps({**REGISTER, "name": "../../etc"}).encode()),
        (register, json.dumps({**REGISTER, "host": "x y"}).encode()),
        (register, json.dumps({k: v for k, v in REGISTER.items() if k != "host"}).encode()),
        (register, b'{"name": "r\\ud800", "role": "rollout", "host": "h", "world_size": 1}'),
        (
            register,
            b'{"name": "r", "role": "rollout", "host": "h", "world_size": 1' + b"9" * 5000 + b"}",
        ),
        (
            "/api/replica/heartbeat",
            b'{"name": "rollout-0", "policy_version": 1, "stats": {"x": NaN}}',
        ),
        (
            "/api/replica/heartbeat",
            b'{"name": "rollout-0", "policy_version": 1, "stats": {"x": 1e999}}',
        ),
        (
            "/api/replica/heartbeat",
            b'{"name": "rollout-0", "policy_version": 1, "stats": {"\\udfff": 1}}',
        ),
        ("/api/replica/heartbeat", b'{"name": "rollout-0", "policy_version": true}'),
        (
            "/api/replica/heartbeat",
            json.dumps({**HEARTBEAT, "stats": {f"k{i}": 1 for i in range(65)}}).encode(),
        ),
        ("/api/replica/unregister", b'{"name": ["rollout-0"]}'),
    ]
    for path, body in cases:
        reply = client.post(path, content=body, headers={**AUTH, **JSON})
        assert 400 <= reply.status_code < 500, (path, body[:80], reply.status_code, reply.text)
    form = client.post(register, data={"name": "r"}, headers=AUTH)
    assert form.status_code == 422
    unknown = client.post(register, json={**REGISTER, "admin": True}, headers=AUTH)
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["type"] == "extra_forbidden"
    assert (
        client.post(register, content=b"x" * (2 << 20), headers={**AUTH, **JSON}).status_code == 413
    )
    chunked = (b"x" * 65536 for _ in range(32))  # no content-length: the cap counts what arrives
    assert client.post(register, content=chunked, headers={**AUTH, **JSON}).status_code == 413
    replicas = client.get("/api/status", headers=AUTH).json()["replicas"]
    assert list(replicas) == ["rollout-0"] and replicas["rollout-0"]["policy_version"] == -1


def _random_value(rng: random.Random, depth: int = 0) -> object:
    choices = [
        lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.choice([0, 1, -1, 2**53, 2**53 + 1]),
        lambda: rng.choice([-1.0, 1.0]) * rng.random() * 10.0 ** rng.randint(-300, 308),
        lambda: rng.choice([float("nan"), float("inf"), -0.0, 1e-320]),
        lambda: rng.choice([True, False, None]),
        lambda: "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 40))),
        lambda: rng.choice(
            ["rollout", "policy", "rollout-0", "", "\x00", "a" * rng.randint(0, 3000)]
        ),
    ]
    if depth < 3:
        choices.append(lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))])
        choices.append(
            lambda: {
                str(_random_value(rng, 3)): _random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 4))
            }
        )
    return rng.choice(choices)()


def _random_body(rng: random.Random, valid: dict[str, object]) -> bytes:
    body = dict(valid)
    for _ in range(rng.randint(0, 3)):
        op = rng.random()
        if op < 0.4 and body:
            body[rng.choice(list(body))] = _random_value(rng)
        elif op < 0.6 and body:
            del body[rng.choice(list(body))]
        elif op < 0.7:
            body[rng.choice(["extra", "stats", "name", "x" * 100])] = _random_value(rng)
    text = json.dumps(body) if rng.random() < 0.95 else "{"
    data = text.encode("utf-8", errors="surrogatepass")
    if rng.random() < 0.1:  # truncate or corrupt the bytes
        data = data[: rng.randint(0, len(data))] + bytes([rng.randint(0, 255)])
    return data


def test_fuzzed_bodies_never_get_5xx(client: httpx.Client) -> None:
    rng = random.Random(1234)
    valid = {
        "/api/replica/register": REGISTER,
        "/api/replica/heartbeat": HEARTBEAT,
        "/api/replica/unregister": {"name": "rollout-0"},
    }
    codes: dict[int, int] = {}
    deadline = time.monotonic() + 20.0
    for i in range(200):
        if time.monotonic() > deadline:
            break
        path = rng.choice(list(valid))
        body = _random_body(rng, valid[path])
        reply = client.post(path, content=body, headers={**AUTH, **JSON})
        assert reply.status_code < 500, (i, path, body[:200], reply.text)
        codes[reply.status_code] = codes.get(reply.status_code, 0) + 1
        if i % 20 == 0:
            assert client.get("/api/status", headers=AUTH).status_code == 200
    assert sum(codes.values()) >= 100, codes
    assert codes.get(200, 0) > 0 and codes.get(422, 0) > 0, codes  # it exercised both sides


# -- state: ledger, registry, restart -------------------------------------------------------------


def _rollout(state: JobState, consumer: str, count: int, versions: dict[int, int]) -> list[int]:
    """A rollout replica's turn: claim, push one group per prompt (version by index), ack."""
    claimed = state.claim_prompts(consumer, count)
    for _, prompt in claimed:
        state.push_group(
            _group(prompt, versions.get(prompt.index, state.policy_version()), consumer)
        )
    state.ack_prompts([msg_id for msg_id, _ in claimed])
    return [prompt.index for _, prompt in claimed]


def _drain(state: JobState, allowed_outdated_steps: int) -> int:
    """The controller's turn: judge every pushed group; returns how many were accepted."""
    accepted = 0
    while groups := state.poll_groups(8):
        for msg_id, group in groups:
            accepted += state.accept_group(
                group, state.policy_version(), allowed_outdated_steps, msg_id=msg_id
            )
    return accepted


def _train(state: JobState, size: int, trained: list[str]) -> None:
    """The policy's turn: train every full batch, one version per step."""
    while (batch := state.next_batch(size)) is not None:
        ids = [g.prompt.prompt_id for g in batch]
        assert state.next_batch(size) == batch  # in flight until marked trained
        state.mark_trained(ids, step=state.step() + 1)
        state.bump_policy_version()
        trained.extend(ids)


def test_ledger_trains_every_prompt_exactly_once(state: JobState) -> None:
    assert state.enqueue_prompts(_prompts(20)) == 20
    assert (
        state.enqueue_prompts(_prompts(20)) == 0
    )  # idempotent: a restarted controller re-enqueues
    trained: list[str] = []

    a = state.claim_prompts("rollout-a", 6)
    assert [p.index for _, p in a] == [0, 1, 2, 3, 4, 5]
    assert [p.index for _, p in state.claim_prompts("rollout-b", 6)] == [6, 7, 8, 9, 10, 11]
    # rollout-a pushes prompt 0's group, then dies before acknowledging anything.
    state.push_group(_group(a[0][1], 0, "rollout-a"))
    assert state.requeue_pending("rollout-a") == 6
    assert state.redis.xpending(state.key("prompts"), "rollout")["pending"] == 6  # b's only
    assert state.ledger_summary(0)["requeued"] == 6

    # rollout-b finishes its six and, redelivering, pushes prompt 6 twice.
    claimed_b = state.redis.xpending_range(
        state.key("prompts"), "rollout", "-", "+", 10, "rollout-b"
    )
    for entry in claimed_b:
        fields = state.redis.xrange(state.key("prompts"), entry["message_id"], entry["message_id"])
        prompt = Prompt(**json.loads(fields[0][1]["prompt"]))
        state.push_group(_group(prompt, 0, "rollout-b"))
        if prompt.index == 6:
            state.push_group(_group(prompt, 0, "rollout-b"))
    state.ack_prompts([e["message_id"] for e in claimed_b])
    assert _drain(state, allowed_outdated_steps=1) == 7  # 0 and 6..11; the second 6 is dropped
    _train(state, 4, trained)
    assert trained == ["0:0", "0:6", "0:7", "0:8"] and state.buffer_size() == 3

    # The policy moves on to version 3; prompts 12 and 13 come back from version 0: too stale.
    state.bump_policy_version()
    state.bump_policy_version()
    assert state.policy_version() == 3
    indices = _rollout(state, "rollout-b", 100, versions={12: 0, 13: 0})
    assert sorted(indices) == [*range(6), *range(12, 20)]
    assert _drain(state, allowed_outdated_steps=1) == 11  # 0 is a duplicate, 12 and 13 stale
    summary = state.ledger_summary(0)
    assert summary["requeued"] == 2 and summary["stale_dropped"] == 2
    assert sorted(_rollout(state, "rollout-b", 100, versions={})) == [12, 13]
    assert _drain(state, allowed_outdated_steps=1) == 2
    _train(state, 4, trained)

    assert sorted(trained) == sorted(p.prompt_id for p in _prompts(20))
    assert len(trained) == len(set(trained)) == 20
    assert state.ledger_summary(0) == {
        "total": 20,
        "outstanding": 0,
        "requeued": 0,
        "completed": 0,
        "filtered": 0,
        "trained": 20,
        "trained_more_than_once": 0,
        "requeue_events": 8,
        "duplicates_dropped": 2,
        "stale_dropped": 2,
        "trajectories_lost": 0,
    }
    assert state.claim_prompts("rollout-b", 100) == [] and state.poll_groups(100) == []
    assert state.buffer_size() == 0 and state.next_batch(1) is None
    assert state.redis.xpending(state.key("prompts"), "rollout")["pending"] == 0
    with pytest.raises(ValueError, match="not the batch in flight"):
        state.mark_trained(["0:1"], step=99)


def test_dead_replicas_are_reaped_and_their_prompts_requeued(redis_server: RedisServer) -> None:
    now = [1000.0]
    state = JobState(connect(redis_server.url), "job-1", clock=lambda: now[0])
    state.register_replica("a", role="rollout", host="h", world_size=1)
    state.register_replica("b", role="rollout", host="h", world_size=1)
    state.enqueue_prompts(_prompts(5))
    assert len(state.claim_prompts("b", 2)) == 2
    now[0] += 20
    assert state.heartbeat("a", policy_version=0, stats={})
    now[0] += 15
    assert state.dead_replicas(30.0) == ["b"]
    assert state.reap_dead_replicas(30.0) == ["b"]
    assert list(state.replicas()) == ["a"] and not state.heartbeat("b", policy_version=0, stats={})
    assert state.ledger_summary(0)["requeued"] == 2
    assert sorted(p.index for _, p in state.claim_prompts("a", 10)) == [0, 1, 2, 3, 4]


def test_restarted_controller_and_redis_find_the_job(tmp_path: Path) -> None:
    data_dir = tmp_path / "redis"
    with start_redis(data_dir=data_dir) as server:
        password = server.password
        state = JobState(connect(server.url), "job-1")
        state.enqueue_prompts(_prompts(10))
        state.register_replica("rollout-0", role="rollout", host="h", world_size=1)
        for _ in range(3):
            state.bump_policy_version()
        _rollout(state, "rollout-0", 4, versions={})
        _drain(state, allowed_outdated_steps=0)
        assert state.next_batch(2) is not None
        state.mark_trained(["0:0", "0:1"], step=1)
        assert state.next_batch(2) is not None  # 0:2, 0:3 in flight when the controller dies
        held = state.claim_prompts("rollout-0", 3)  # 4, 5, 6 held by a rollout
        state.push_group(_group(held[0][1], 3))
        assert len(state.poll_groups(10)) == 1  # read, not yet judged, when the controller dies
        before = state.ledger_summary(0)

        again = JobState(connect(server.url), "job-1")  # a new controller on the same Redis
        assert again.policy_version() == 3 and again.step() == 1
        assert again.ledger_summary(0) == before

    with start_redis(data_dir=data_dir, password=password) as server:  # Redis restarts from its AOF
        state = JobState(connect(server.url), "job-1")
        assert state.policy_version() == 3 and state.step() == 1
        assert state.ledger_summary(0) == before
        assert before["trained"] == 2 and before["completed"] == 2 and before["outstanding"] == 6
        assert list(state.replicas()) == ["rollout-0"]
        assert [g.prompt.prompt_id for g in state.next_batch(2)] == ["0:2", "0:3"]
        unjudged = state.poll_groups(10)
        assert [g.prompt.prompt_id for _, g in unjudged] == ["0:4"]
        assert state.accept_group(unjudged[0][1], 3, 0, msg_id=unjudged[0][0])
        assert state.requeue_pending("rollout-0") == 2  # 5 and 6; 4 is already accepted
        assert sorted(p.index for _, p in state.claim_prompts("rollout-1", 10)) == [5, 6, 7, 8, 9]
