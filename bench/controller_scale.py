"""Controller scale: hundreds to thousands of simulated rollout replicas against a real controller
and Redis, once per `--clients` number (256 and 1,024 by default).

What a rollout replica does to the controller, `--clients` times over, with no model behind it:

- control plane (HTTP, `nebula_rl.controller.client.ControllerClient`): fetch `/api/meta`,
  register, then a heartbeat every `heartbeat_s` (the interval `ReplicaSession` derives from
  `controller.heartbeat_timeout`: 2 s by default), unregister at the end; the heartbeats are
  `ControllerClient.heartbeat`'s request written as plain HTTP/1.1 on asyncio streams, one
  keep-alive connection per replica (see :func:`control_plane` for why);
- data plane (Redis, `nebula_rl.controller.state.JobState`): claim up to 4 prompts
  (`claim_prompts`, blocking 200 ms when there are none), and for each push a scored group of
  `--n-generation` completions of `--response-tokens` tokens (`push_group`, XADD) and acknowledge
  the prompt (`ack_prompts`): `rollout/worker.py`'s calls, without generation time, so the
  controller is the bottleneck.

The controller is the real one (`nebula-rl controller`: the scheduler loop judging every group,
ledger, staleness filter, step scheduling, and its HTTP API in a process of its own) on a Redis
this script starts; one policy replica is simulated in this process (it reads each `train` command and the
in-flight batch, and reports the step done at once). Heartbeats come from one process and the
data plane from another (64 threads, each acting as its share of the replicas in turn), so that
a busy data-plane client does not delay the timing of heartbeats in its own interpreter.

Peer, measured in the same run under the same load (same clients, payloads and rates), each
phase on a fresh Redis: the bare transports. The same data-plane threads XADD the same group payloads to a raw Redis stream
(nothing claims, judges or acknowledges them), and the heartbeats go to a bare FastAPI app with a
no-op handler served by the same uvicorn set-up in its own process. So the ratios say what the
controller's work costs on top of the transports it is built on:

- completions/s: groups the controller accepted into its buffer in the window x n_generation,
  against completions XADDed to the raw stream. Goal (set here; the issue gives none): at least
  0.5x, i.e. the ledger, judging and scheduling cost at most as much as the transport itself.
- heartbeat p99 latency: the no-op's p99 / the controller's p99 (a speed ratio, higher is
  better). Goal (set here): at least 0.5x, i.e. at most twice the bare HTTP round trip.

Each configuration prints its table and two SUMMARY lines (`..._256`, `..._1024`).

    python bench/controller_scale.py [--clients 256 1024] [--seconds 15]
        [--response-tokens 128] [--n-generation 8] [--batch 256]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from nebula_rl.config import ControllerConfig, config_from_dict
from nebula_rl.controller import JobState, connect, start_redis
from nebula_rl.controller.client import REDIS_URL_ENV, TOKEN_ENV, ControllerClient, ReplicaSession
from nebula_rl.protocol import Completion, Prompt, RolloutGroup, to_json
from nebula_rl.weights import free_port

COMPLETIONS_GOAL = 0.5
LATENCY_GOAL = 0.5
JOB = "scale"
"""Job name: the controller derives it from its run folder's name."""
RAW_STREAM = "bench:raw-groups"
CLAIM = 4
"""Prompts a simulated rollout claims at once."""
WARMUP_S = 3.0
"""Seconds of load before the measuring window opens."""
DATA_THREADS = 64
"""Threads of the data plane; each acts as `--clients / DATA_THREADS` replicas in turn (a Redis
consumer name each). More threads only wait for the client's interpreter lock: 1,024 of them
on 2 cores took minutes to start and seconds per push."""


Parts = list[tuple[list[int], list[float], str, float]]
"""Pre-drawn (token ids, log-probs, text, reward) of completions: drawing random numbers is not
what a rollout spends its time on, so the clients draw them once and reuse them."""


def draw_parts(n: int, tokens: int, rng: random.Random) -> Parts:
    """`n` completions' worth of random content."""
    return [
        (
            [rng.randrange(32000) for _ in range(tokens)],
            [-rng.random() * 3 for _ in range(tokens)],
            "".join(rng.choices("0123456789 +=abcdefgh", k=4 * tokens)),
            float(rng.random() < 0.5),
        )
        for _ in range(n)
    ]


def make_group(prompt: Prompt, parts: Parts, *, version: int) -> RolloutGroup:
    """A scored group shaped like a rollout's: token ids, log-probs, text, reward, version."""
    completions = [
        Completion(ids, logprobs, text, "stop", [(0, version)], reward)
        for ids, logprobs, text, reward in parts
    ]
    return RolloutGroup(prompt, list(range(30)), completions, replica="sim")


# -- child processes ------------------------------------------------------------------------------


def data_plane(
    mode: str, redis_url: str, args: argparse.Namespace, stop: Any, out: Any, ready: Any
) -> None:
    """Child process: `--clients` rollouts pushing groups (`controller`: claim, push, ack as
    each replica in turn) or bare XADDs (`raw`), from at most :data:`DATA_THREADS` threads;
    reports (end time, seconds, completions) of every push."""
    records: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    stop = local_event(stop)
    num_threads = min(args.clients, DATA_THREADS)

    def client(index: int) -> None:
        parts = draw_parts(args.n_generation, args.response_tokens, random.Random(index))
        redis = connect(redis_url)
        names = itertools.cycle(f"rollout-{i}" for i in range(index, args.clients, num_threads))
        state = JobState(redis, JOB) if mode == "controller" else None
        template = Prompt("0:0", 0, 0, "1+2=", "3")
        mine: list[tuple[float, float, int]] = []
        for _ in range(index, args.clients, num_threads):
            ready.release()
        while not stop.is_set():
            name = next(names)
            if state is None:
                group = make_group(template, parts, version=0)
                start = time.perf_counter()
                redis.xadd(RAW_STREAM, {"group": to_json(group)}, maxlen=10000, approximate=True)
                mine.append((time.time(), time.perf_counter() - start, args.n_generation))
                continue
            for msg_id, prompt in state.claim_prompts(name, CLAIM, block_ms=200):
                group = make_group(prompt, parts, version=prompt.min_version)
                start = time.perf_counter()
                state.push_group(group)
                state.ack_prompts([msg_id])
                mine.append((time.time(), time.perf_counter() - start, args.n_generation))
        redis.close()
        with lock:
            records.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(("pushes", records))


def control_plane(
    mode: str, address: str, token: str, args: argparse.Namespace, stop: Any, out: Any, ready: Any
) -> None:
    """Child process: `--clients` replicas that join (controller mode: `ControllerClient`'s
    meta and register), then send `ControllerClient.heartbeat`'s request every `heartbeat_s`,
    each over a keep-alive connection of its own, all on one event loop; reports (time,
    seconds, ok) of every heartbeat.

    The heartbeats are written and read as plain HTTP/1.1 on asyncio streams: what is timed is
    the server. A thread per replica with httpx timed this process instead (its interpreter
    lock: 1,024 threads on 2 cores wait seconds for it), and httpx's async client spent more
    CPU per request than the servers it measured."""
    names = [f"rollout-{index}" for index in range(args.clients)]
    api = ControllerClient(address, token)
    if mode == "controller":
        api.meta()
        for name in names:
            api.register(name, role="rollout")
    for _ in names:
        ready.release()
    records = asyncio.run(heartbeats(address, token, names, args.heartbeat_s, stop))
    if mode == "controller":
        for name in names:
            api.unregister(name)
    api.close()
    out.put(("beats", records))


async def heartbeats(
    address: str, token: str, names: list[str], interval_s: float, stop: Any
) -> list[tuple[float, float, bool]]:
    """Heartbeat as each of `names` every `interval_s` (first beats spread over an interval)
    until `stop` is set; (end time, seconds, answered 2xx) of each. A failed beat (an error,
    or no answer in 30 s) counts with the time it took; the replica reconnects for the next."""
    host, port = address.rsplit(":", 1)
    records: list[tuple[float, float, bool]] = []

    async def beat(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
    ) -> bool:
        writer.write(request)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        return 200 <= status < 300

    async def replica(index: int, name: str) -> None:
        body = json.dumps(
            {"name": name, "policy_version": 0, "stats": {"tokens_per_s": 1.0, "groups": 1.0}}
        ).encode()
        request = (
            f"POST /api/replica/heartbeat HTTP/1.1\r\nHost: {address}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + random.Random(index).random() * interval_s
        connection = None
        while not stop.is_set():
            await asyncio.sleep(max(0.0, next_beat - loop.time()))
            next_beat += interval_s
            start = time.perf_counter()
            try:
                if connection is None:
                    connection = await asyncio.open_connection(host, int(port))
                ok = await asyncio.wait_for(beat(*connection, request), 30.0)
            except (OSError, ValueError, IndexError, TimeoutError, asyncio.IncompleteReadError):
                ok = False
            if not ok and connection is not None:
                connection[1].close()
                connection = None
            records.append((time.time(), time.perf_counter() - start, ok))
        if connection is not None:
            connection[1].close()

    await asyncio.gather(*(replica(i, name) for i, name in enumerate(names)))
    return records


def local_event(shared: Any) -> threading.Event:
    """A copy of the multiprocessing event `shared` for this process's threads, set when it is:
    hundreds of threads polling a multiprocessing event contend for its process-shared lock."""
    local = threading.Event()

    def follow() -> None:
        shared.wait()
        local.set()

    threading.Thread(target=follow, daemon=True).start()
    return local


def noop_server(port: int) -> None:
    """Child process: the peer of the HTTP API, a FastAPI app whose heartbeat does nothing."""
    from fastapi import FastAPI

    from nebula_rl.controller import serve

    app = FastAPI(docs_url=None, redoc_url=None)

    @app.post("/api/replica/heartbeat")
    def heartbeat() -> dict[str, Any]:
        return {}

    serve(app, port=port)
    threading.Event().wait()


# -- this process ---------------------------------------------------------------------------------


def simulated_policy(session: ReplicaSession, stop: threading.Event) -> None:
    """Policy replica stand-in, speaking `policy/worker.py`'s protocol: report ready, confirm
    each `regroup` (it is the only member), and answer each `train` command at once after
    reading the in-flight batch as the real one does."""
    state, name = session.state, session.name
    session.mark_ready()
    version, rank, last = 0, 0, None
    while not stop.is_set():
        for msg_id, command in state.read_commands(name, block_ms=100):
            if command["type"] == "regroup":
                group = command["group"]
                rank = group["members"].index(name)
                confirmed = last if last is not None and last["step"] == version else None
                result = {"type": "regrouped", "generation": group["generation"], "rank": rank}
                state.push_result(
                    {**result, "version": version, "last_result": confirmed, "name": name}
                )
            elif command["type"] == "train":
                groups = state.inflight_batch()
                rewards = [r for g in groups for r in g.rewards]
                last = {
                    "type": "train",
                    "generation": command["generation"],
                    "rank": rank,
                    "step": command["step"],
                    "prompt_ids": command["prompt_ids"],
                    "metrics": {"reward_mean": sum(rewards) / len(rewards), "loss": 0.0},
                    "train_time": 0.0,
                    "name": name,
                }
                version = command["step"]
                state.push_result(last)
            state.ack_command(name, msg_id)


def accepted_groups(state: JobState) -> int:
    """Groups the controller accepted so far (in the buffer, trained or filtered)."""
    total = 0
    for epoch in state.epochs():
        s = state.ledger_summary(epoch)
        total += s["completed"] + s["trained"] + s["filtered"]
    return total


def wait_healthy(address: str, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Until `address` answers /health."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server at {address} exited with {process.returncode}")
        try:
            if httpx.get(f"http://{address}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{address} did not answer within {timeout_s:.0f} s")


def controller_config(args: argparse.Namespace) -> dict[str, Any]:
    """The job the controller runs: large enough never to finish within the bench."""
    return {
        "train": {
            "train_batch_per_replica": args.batch,
            "max_num_steps": 1_000_000,
            "epoch": 1000,
            "train_policy": {
                "type": "grpo",
                "reward_function": "arithmetic",
                "allowed_outdated_steps": 1,
                "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": args.rows}},
            },
        },
        "policy": {"model_name_or_path": "tiny:qwen2"},
        "rollout": {
            "n_generation": args.n_generation,
            "max_response_length": args.response_tokens,
        },
        "controller": {
            "scheduler_niceness": args.scheduler_niceness,
            "api_processes": args.api_processes,
        },
    }


def run_phase(
    mode: str, args: argparse.Namespace, *, redis_url: str, address: str, token: str
) -> dict[str, Any]:
    """Start the clients against `address` (and Redis), measure a window, stop them."""
    ctx = mp.get_context("spawn")
    stop, ready, out = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
    procs = [
        ctx.Process(target=control_plane, args=(mode, address, token, args, stop, out, ready)),
        ctx.Process(target=data_plane, args=(mode, redis_url, args, stop, out, ready)),
    ]
    state = JobState(connect(redis_url), JOB) if mode == "controller" else None
    for p in procs:
        p.start()
    for _ in range(2 * args.clients):
        if not ready.acquire(timeout=300):
            stop.set()
            raise SystemExit("the simulated clients did not start within 300 s")
    time.sleep(WARMUP_S)
    t0 = time.time()
    start_count = accepted_groups(state) if state else 0
    time.sleep(args.seconds)
    t1 = time.time()
    end_count = accepted_groups(state) if state else 0
    steps = state.step() if state else 0
    if state is not None:
        state.redis.close()
    stop.set()
    reports = dict(out.get(timeout=300) for _ in procs)
    beats, pushes = reports["beats"], reports["pushes"]
    for p in procs:
        p.join(timeout=60)
    in_window = [r for r in pushes if t0 <= r[0] < t1]
    pushed = sum(r[2] for r in in_window)
    handled = (end_count - start_count) * args.n_generation if state else pushed
    beat_s = sorted(s for t, s, _ in beats if t0 <= t < t1)
    failed = sum(not ok for t, _, ok in beats if t0 <= t < t1)
    push_s = sorted(s for _, s, _ in in_window)
    return {
        "completions_per_s": handled / (t1 - t0),
        "pushed_per_s": pushed / (t1 - t0),
        "beats_per_s": len(beat_s) / (t1 - t0),
        "beats_failed": failed,
        "beat_p50": percentile(beat_s, 50),
        "beat_p99": percentile(beat_s, 99),
        "push_p50": percentile(push_s, 50),
        "push_p99": percentile(push_s, 99),
        "steps": steps,
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of already sorted values; NaN when empty."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values)) - 1))
    return sorted_values[rank]


def measure(args: argparse.Namespace, token: str) -> dict[str, dict[str, Any]]:
    """One configuration (`args.clients` replicas): the controller, then the bare transports,
    each on a fresh Redis."""
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="nebula-bench-scale-") as tmp:
        run_dir = Path(tmp) / JOB
        run_dir.mkdir()
        config = run_dir / "config.json"
        config.write_text(config_from_dict(controller_config(args)).model_dump_json())
        with start_redis(data_dir=Path(tmp) / "redis") as redis_server:
            env = {**os.environ, REDIS_URL_ENV: redis_server.url}
            port = free_port("127.0.0.1")
            address = f"127.0.0.1:{port}"
            command = [sys.executable, "-m", "nebula_rl.cli", "--log-level", "warning"]
            command += ["controller", "--config", str(config), "--run-dir", str(run_dir)]
            command += ["--host", "127.0.0.1", "--port", str(port), "--policy", "1"]
            command += ["--rollout", str(args.clients)]
            controller = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
            try:
                wait_healthy(address, controller)
                policy = ReplicaSession.join(address, name="policy-0", role="policy")
                policy.start_heartbeats()
                stop_policy = threading.Event()
                thread = threading.Thread(target=simulated_policy, args=(policy, stop_policy))
                thread.start()
                results["controller"] = run_phase(
                    "controller", args, redis_url=redis_server.url, address=address, token=token
                )
                stop_policy.set()
                thread.join()
                policy.leave()
            finally:
                controller.terminate()  # (its API process sees it and stops too)
                controller.wait(timeout=30)

        with start_redis(data_dir=Path(tmp) / "redis-bare") as redis_server:
            port = free_port("127.0.0.1")
            address = f"127.0.0.1:{port}"
            ctx = mp.get_context("spawn")
            server = ctx.Process(target=noop_server, args=(port,), daemon=True)
            server.start()
            try:
                wait_healthy_noop(address)
                results["bare"] = run_phase(
                    "raw", args, redis_url=redis_server.url, address=address, token=token
                )
            finally:
                server.terminate()
                server.join(timeout=30)
    return results


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    """The table and the SUMMARY lines of one configuration."""
    c, b = results["controller"], results["bare"]
    parts = draw_parts(args.n_generation, args.response_tokens, random.Random(0))
    payload = len(to_json(make_group(Prompt("0:0", 0, 0, "1+2=", "3"), parts, version=0)))
    print(
        f"\n{args.clients} simulated rollouts, groups of {args.n_generation} x "
        f"{args.response_tokens} tokens ({payload / 1024:.0f} KiB as JSON), heartbeat every "
        f"{args.heartbeat_s:g} s, {args.batch} groups per step, {args.seconds:g} s window, "
        f"{os.cpu_count()} cores shared by Redis, the server and the clients, "
        f"scheduler niceness {args.scheduler_niceness}, {args.api_processes} API process(es)"
    )
    print(
        f"{'path':44} {'compl/s':>8} {'beats/s':>8} {'failed':>7} {'beat p50 ms':>12} "
        f"{'beat p99 ms':>12} {'push p50 ms':>12} {'push p99 ms':>12}"
    )
    for name, r in (
        ("controller (HTTP API + scheduler + ledger)", c),
        ("bare (no-op FastAPI, raw XADD)", b),
    ):
        print(
            f"{name:44} {r['completions_per_s']:8.0f} {r['beats_per_s']:8.1f} "
            f"{r['beats_failed']:7d} {r['beat_p50'] * 1e3:12.1f} {r['beat_p99'] * 1e3:12.1f} "
            f"{r['push_p50'] * 1e3:12.1f} {r['push_p99'] * 1e3:12.1f}"
        )
    print(
        f"controller: {c['steps']} training steps scheduled in all; completions pushed by the "
        f"clients {c['pushed_per_s']:.0f}/s, accepted {c['completions_per_s']:.0f}/s "
        f"({c['completions_per_s'] * args.response_tokens:.0f} tokens/s)"
    )
    completions = c["completions_per_s"] / b["completions_per_s"]
    latency = b["beat_p99"] / c["beat_p99"]
    n = args.clients
    print(
        f"SUMMARY controller_completions_vs_raw_xadd_{n} {completions:.2f}x "
        f"goal {COMPLETIONS_GOAL}x"
    )
    print(f"SUMMARY controller_heartbeat_p99_vs_noop_{n} {latency:.2f}x goal {LATENCY_GOAL}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=[256, 1024],
        help="simulated rollout replicas: one configuration per number",
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="measuring window per phase")
    parser.add_argument("--n-generation", type=int, default=8, help="completions per group")
    parser.add_argument("--response-tokens", type=int, default=128, help="tokens per completion")
    parser.add_argument("--batch", type=int, default=256, help="groups per training step")
    parser.add_argument("--rows", type=int, default=20000, help="dataset rows (per epoch)")
    parser.add_argument(
        "--scheduler-niceness",
        type=int,
        default=ControllerConfig().scheduler_niceness,
        help="the controller's controller.scheduler_niceness (0: the loop at the API's priority)",
    )
    parser.add_argument(
        "--api-processes",
        type=int,
        default=ControllerConfig().api_processes,
        help="the controller's controller.api_processes",
    )
    args = parser.parse_args()
    heartbeat_timeout = config_from_dict(controller_config(args)).controller.heartbeat_timeout
    args.heartbeat_s = max(0.2, min(2.0, heartbeat_timeout / 5))  # as ReplicaSession.join

    token = os.urandom(16).hex()
    os.environ[TOKEN_ENV] = token
    configurations = args.clients
    for clients in configurations:
        args.clients = clients
        report(args, measure(args, token))


def wait_healthy_noop(address: str, timeout_s: float = 60) -> None:
    """Until the no-op server answers (it has no /health: any HTTP answer will do)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://{address}/", timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{address} did not answer within {timeout_s:.0f} s")


if __name__ == "__main__":
    main()
