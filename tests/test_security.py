"""Security and bad input, against a real controller process started by hand
(`nebula-rl controller`, which makes the job's token, writes it to `<run>/token` and starts its
own Redis): strangers get nothing, everything listens on loopback, no secret leaks into logs or
command lines, and a schema-driven fuzzer (schemathesis, from the controller's own OpenAPI
schema) finds no request that makes it fail (5xx).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from nebula_rl.config import config_from_dict
from nebula_rl.weights import free_port

REGISTER = {"name": "rollout-x", "role": "rollout", "host": "node-1", "world_size": 1}


GOOD_ROWS = 16
BAD_LINES = [
    "{not json",
    "[1, 2]",
    '{"prompt": {"text": "1+1="}, "answer": "2"}',
    '{"prompt": "", "answer": "2"}',
    '{"answer": "2"}',
    '{"prompt": [{"role": "user"}], "answer": "2"}',
]
BAD_REASONS = {
    "malformed line (not valid JSON)": 1,
    "malformed line (not a JSON object)": 1,
    "'prompt' is neither text nor chat messages": 2,
    "missing or empty 'prompt'": 2,
}


def _dataset_with_bad_rows(path: Path) -> Path:
    """JSON lines: good `a+b=` rows with the malformed ones of BAD_LINES in between."""
    lines = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(GOOD_ROWS)]
    for k, bad in enumerate(BAD_LINES):
        lines.insert(3 * k + 1, bad)
    lines.insert(5, "")  # a blank line is no row at all
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Controller:
    url: str
    token: str
    process: subprocess.Popen[bytes]
    run_dir: Path
    log: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def _job_config(tmp: Path, port: int) -> Path:
    cfg = config_from_dict(
        {
            "train": {
                "output_dir": str(tmp / "out"),
                "train_batch_per_replica": 16,
                "train_policy": {
                    "type": "grpo",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "reward_function": "arithmetic",
                    "dataset": {"name": str(_dataset_with_bad_rows(tmp / "rows.jsonl"))},
                },
            },
            "policy": {"model_name_or_path": "tiny:qwen2"},
            "rollout": {"backend": "torch", "n_generation": 4},
            "controller": {"port": port},
        },
        source="test",
    )
    config = tmp / "job.json"
    config.write_text(cfg.model_dump_json())
    return config


@contextlib.contextmanager
def _controller(tmp: Path, host: str = "127.0.0.1") -> Iterator[Controller]:
    """A `nebula-rl controller` process started by hand on `host` (its Redis too)."""
    port = free_port(host)
    config = _job_config(tmp, port)
    run_dir, log = tmp / "run", tmp / "controller.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-X",
            "importtime",  # (every import to stderr: the layering test reads them)
            "-m",
            "nebula_rl.cli",
            "controller",
            "--config",
            str(config),
            "--run-dir",
            str(run_dir),
            *(["--host", host] if host != "127.0.0.1" else []),
        ],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its Redis is in its process group: both go at the end
    )
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    try:
        yield Controller(url, (run_dir / "token").read_text().strip(), process, run_dir, log)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    with _controller(tmp_path_factory.mktemp("security")) as started:
        yield started


def _resp(sock: socket.socket, command: bytes) -> bytes:
    sock.sendall(command)
    return sock.recv(256)


def test_unauthenticated_client_can_neither_register_read_config_nor_push_completions(
    controller: Controller,
) -> None:
    strangers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {controller.token}"},
        {"Authorization": f"Bearer {controller.token[:-1]}"},
        {"Cookie": f"token={controller.token}"},
    ]
    with httpx.Client(base_url=controller.url, timeout=10.0) as http:
        for headers in strangers:
            reply = http.post("/api/replica/register", json=REGISTER, headers=headers)
            assert reply.status_code == 401, (headers, reply.text)
            for path in ("/api/meta", "/api/status", "/openapi.json", "/docs"):
                reply = http.get(path, headers=headers)
                assert reply.status_code == 401, (path, headers)
                assert "redis" not in reply.text and "config" not in reply.text
            # No HTTP path takes completions, and strangers cannot even tell which paths exist.
            assert http.post("/api/groups", json={}, headers=headers).status_code == 401
        status = http.get("/api/status", headers=controller.auth).json()
        assert status["replicas"] == {}  # none of the attempts registered anything
        meta = http.get("/api/meta", headers=controller.auth).json()
        assert meta["config"]["controller"]["port"] == int(urlparse(controller.url).port or 0)

        # Completions travel over the job's Redis, whose password only /api/meta gives out.
        redis_url = urlparse(meta["redis_url"])
        assert redis_url.hostname == "127.0.0.1" and redis_url.password
        stream = f"nebula:{meta['job']}:groups"
        push = f"XADD {stream} * group x\r\n".encode()
        with socket.create_connection((redis_url.hostname, redis_url.port), timeout=5) as sock:
            assert _resp(sock, push).startswith(b"-NOAUTH")
            assert _resp(sock, b"AUTH default wrong\r\n").startswith(b"-WRONGPASS")
            assert _resp(sock, push).startswith(b"-NOAUTH")
            assert _resp(sock, f"XLEN {stream}\r\n".encode()).startswith(b"-NOAUTH")

        # The same requests with the token work: the refusals above were about the token.
        reply = http.post("/api/replica/register", json=REGISTER, headers=controller.auth)
        assert reply.status_code == 200, reply.text
        reply = http.post(
            "/api/replica/unregister", json={"name": "rollout-x"}, headers=controller.auth
        )
        assert reply.status_code == 200


def _listening_inodes() -> dict[int, str]:
    """Socket inode -> local address of every listening TCP socket (IPv4 and IPv6)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found[int(fields[9])] = fields[1]
    return found


def _process_tree(root: int) -> list[int]:
    pids = [root]
    for pid in pids:
        children = Path(f"/proc/{pid}/task/{pid}/children")
        if children.exists():
            pids.extend(int(c) for c in children.read_text().split())
    return pids


def _listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses (as /proc/net/tcp writes them) of the listening sockets of `pids`
    (a socket several of them hold, as the controller and its API processes do, once)."""
    listening = _listening_inodes()
    addresses = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:  # (closed meanwhile)
                continue
            if target.startswith("socket:["):
                inode = int(target[len("socket:[") : -1])
                if inode in listening:
                    addresses[inode] = listening[inode]
    return list(addresses.values())


def test_everything_listens_on_loopback_and_secrets_stay_secret(controller: Controller) -> None:
    tree = _process_tree(controller.process.pid)
    assert len(tree) >= 2  # the controller and its Redis
    addresses = _listening_addresses(tree)
    # HTTP API and Redis (the replicas' groups meet in Redis): two listeners, both on 127.0.0.1
    # (hex, little-endian).
    assert len(addresses) == 2, addresses
    loopback = ("0100007F:", "0000000000000000FFFF00000100007F:")
    assert all(a.startswith(loopback) for a in addresses), addresses

    token_file = controller.run_dir / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    meta = httpx.get(f"{controller.url}/api/meta", headers=controller.auth).json()
    password = urlparse(meta["redis_url"]).password
    assert password
    for pid in tree:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert controller.token not in argv and password not in argv
    log = controller.log.read_text()
    assert controller.token not in log and password not in log


def test_fuzzed_requests_never_get_5xx(controller: Controller) -> None:
    """Requests generated by schemathesis from the controller's own OpenAPI schema, valid ones and
    deliberately invalid ones (wrong types, missing or extra fields, out-of-range values), all
    with the token: every answer is a success or a 4xx, never a server error."""
    raw = httpx.get(f"{controller.url}/openapi.json", headers=controller.auth).json()
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"/api/replica/register", "/api/replica/heartbeat", "/api/meta"} <= {
        op.path for op in operations
    }
    codes: dict[int, int] = {}
    for operation in operations:
        raw_op = operation.definition.raw
        # (an operation without body or parameters has no invalid variant to generate)
        invalid = "requestBody" in raw_op or bool(raw_op.get("parameters"))
        for mode in GenerationMode if invalid else [GenerationMode.POSITIVE]:

            @settings(
                max_examples=25,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case: schemathesis.Case) -> None:
                response = case.call(base_url=controller.url, headers=controller.auth, timeout=10)
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                assert response.status_code < 500, (
                    case.method,
                    case.formatted_path,
                    case.body,
                    response.text[:300],
                )

            call()
    # Both sides were exercised: accepted requests and refused ones.
    assert codes.get(200, 0) > 0 and sum(n for c, n in codes.items() if 400 <= c < 500) > 0, codes


def test_malformed_rows_are_counted_and_reported_not_fatal(controller: Controller) -> None:
    """The controller above was started on a JSON lines file with malformed rows: it serves the
    job from the good rows and reports the others by reason."""
    report = json.loads((controller.run_dir / "dataset.json").read_text())
    assert report == {
        "num_rows": GOOD_ROWS + len(BAD_LINES),
        "num_bad": len(BAD_LINES),
        "reasons": BAD_REASONS,
    }
    meta = httpx.get(f"{controller.url}/api/meta", headers=controller.auth).json()
    assert (
        meta["total_steps"] == GOOD_ROWS // 4
    )  # 4 prompts per step (train_batch_per_replica 16 / n_generation 4)
    log = controller.log.read_text()
    assert f"{len(BAD_LINES)} unusable" in log


def test_a_dataset_without_usable_rows_is_a_clear_error(tmp_path: Path) -> None:
    from nebula_rl.data import rl_dataset

    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_LINES) + "\n")
    cfg = config_from_dict(
        {
            "train": {
                "train_policy": {
                    "type": "grpo",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "dataset": {"name": str(path)},
                }
            }
        }
    )
    with pytest.raises(
        ValueError, match=r"has no usable row: 6 rows, 6 unusable \(.*malformed line"
    ):
        rl_dataset(cfg)


def test_invalid_model_path_and_impossible_parallel_sizes_fail_at_start(tmp_path: Path) -> None:
    """`nebula-rl train` refuses them before it starts any process, naming the key."""
    from nebula_rl.launch import check_job

    base = {
        "train": {
            "output_dir": str(tmp_path / "out"),
            "train_policy": {
                "type": "grpo",
                "prompt_column_name": "prompt",
                "response_column_name": "answer",
                "reward_function": "arithmetic",
                "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 8}},
            },
        },
        "policy": {"model_name_or_path": str(tmp_path / "missing")},
        "rollout": {"backend": "torch"},
    }
    config = tmp_path / "job.json"
    config.write_text(json.dumps(base))
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    said = " ".join((result.stdout + result.stderr).split())
    assert "policy.model_name_or_path" in said
    assert "neither a local folder nor a Hugging Face Hub id" in said
    assert not (tmp_path / "out").exists()  # nothing started: no run folder, no logs

    cases = [
        # (tiny:qwen2 has 4 attention heads and 4 layers)
        ({"policy": {"parallelism": {"tp_size": 3}}}, r"tp_size \(3\) must divide num_attention"),
        ({"policy": {"parallelism": {"pp_size": 5}}}, r"pp_size \(5\) must not exceed num_hidden"),
        (
            {"policy": {"parallelism": {"pp_size": 2, "pp_micro_batch_size": 8}}},
            r"pp_micro_batch_size \(8\) must divide mini_batch",
        ),
        ({"rollout": {"backend": "vllm"}}, r'rollout.backend = "vllm" .*needs the vllm package'),
    ]
    for change, message in cases:
        cfg = config_from_dict({**base, "policy": {"model_name_or_path": "tiny:qwen2"}, **change})
        with pytest.raises(ValueError, match=message):
            check_job(cfg)


def test_the_controller_process_imports_neither_torch_nor_transformers(
    controller: Controller,
) -> None:
    """The controller never touches a tensor: a started one (serving, with a job's state in
    Redis and replicas' requests answered by the tests above) has imported neither."""
    with httpx.Client(base_url=controller.url, timeout=10.0) as http:
        assert http.get("/api/status", headers=controller.auth).status_code == 200
        assert http.get("/api/meta", headers=controller.auth).status_code == 200
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in controller.log.read_text().splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert {"nebula_rl.controller.scheduler", "fastapi", "redis"} <= imported  # (it did log)
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "transformers", "datasets")}
    assert heavy == set()


def _group_member(member: int, redis_url: str, name: str) -> tuple:
    """Members 0 and 1 join weight group `name` in the job's Redis and broadcast; member 2 is a
    rogue that knows Redis's address (from `redis_url` without its password, or with a wrong
    one) and tries to take rank 1's place."""
    from datetime import timedelta

    import redis
    import torch

    from nebula_rl.weights import Rendezvous, build_group

    if member == 2:
        outcomes = []
        url = urlparse(redis_url)
        for password in ("", ":wrong"):
            rogue = redis.Redis.from_url(
                f"redis://{password and password + '@'}{url.hostname}:{url.port}"
            )
            rdzv = Rendezvous("", 0, name, 2, redis=rogue)
            start = time.monotonic()
            try:
                build_group(rdzv, rank=1, timeout=timedelta(seconds=20))
                outcomes.append(("joined", time.monotonic() - start))
            except redis.RedisError as err:
                outcomes.append((type(err).__name__, time.monotonic() - start))
        return tuple(outcomes)
    rdzv = Rendezvous("", 0, name, 2, redis=redis.Redis.from_url(redis_url))
    group = build_group(rdzv, rank=member, timeout=timedelta(seconds=30))
    tensor = torch.tensor([7.0 if member == 0 else 0.0])
    group.pg.broadcast(tensor, 0, group.timeout).wait()
    mine = _listening_addresses([os.getpid()])
    group.close()
    return (float(tensor[0]), sorted({a.split(":")[0] for a in mine}))


def test_a_rogue_that_knows_the_rendezvous_port_can_neither_join_nor_stall_a_group(
    tmp_path: Path,
) -> None:
    """Weight groups meet in the job's Redis (no TCPStore port): a process that knows its address
    but not its password is refused at once and leaves no key behind, and the members then form
    the group (listening on loopback only) and broadcast as usual."""
    import redis

    from member_pool import MemberPool
    from nebula_rl.controller import start_redis

    with start_redis(data_dir=tmp_path / "redis") as server:
        pool = MemberPool(3)
        try:
            (rogue,) = pool.run_on([2], _group_member, server.url, "weights-1").values()
            assert [kind for kind, _ in rogue] == ["AuthenticationError", "AuthenticationError"]
            assert all(seconds < 5 for _, seconds in rogue)  # refused, not left waiting
            assert redis.Redis.from_url(server.url).keys("*weights-1*") == []
            members = pool.run_on([0, 1], _group_member, server.url, "weights-1")
            # The group's sockets listen on loopback only, like every port of a one-host job.
            assert members == {0: (7.0, ["0100007F"]), 1: (7.0, ["0100007F"])}
        finally:
            pool.close()


def test_a_controller_on_another_address_puts_its_redis_there_and_refuses_a_wildcard(
    tmp_path: Path,
) -> None:
    """Replicas on other hosts dial the controller's Redis: started by hand with `--host`, the
    controller binds its Redis (and only it and the API) to that address; `--host 0.0.0.0` would
    give replicas a URL they cannot dial and is refused (exit 2)."""
    host = "127.0.0.2"  # (a loopback address that is not 127.0.0.1)
    with _controller(tmp_path, host=host) as started:
        meta = httpx.get(f"{started.url}/api/meta", headers=started.auth).json()
        assert urlparse(meta["redis_url"]).hostname == host
        addresses = _listening_addresses(_process_tree(started.process.pid))
        assert len(addresses) == 2 and all(a.startswith("0200007F:") for a in addresses)
    wildcard = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "controller", "--config",
         str(_job_config(tmp_path, free_port())), "--run-dir", str(tmp_path / "wild"),
         "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")},
    )  # fmt: skip
    assert wildcard.returncode == 2, wildcard.stderr
    assert "give one address" in wildcard.stdout + wildcard.stderr
