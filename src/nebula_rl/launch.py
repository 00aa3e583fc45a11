"""The launcher: the only place that starts processes.

`launch(cfg, ...)` runs a whole RL job on this machine:

1. builds the warm-start model if the config asks for one and it is missing;
2. starts Redis (a private server with a password, unless `redis` names an external one);
3. starts the controller (`nebula-rl controller`), then each replica as its own `torchrun` group
   (`nebula-rl replica`): policy replicas first, then rollout replicas;
4. supervises: prints each training step as the controller records it, forwards SIGINT/SIGTERM
   to every child, and stops everything when the controller ends or any process fails.

It returns 0 only when the controller finished the job. Secrets (the job's token, the Redis URL
with its password) reach the children through their environment, never their command line.
Each process logs to `<run>/logs/<name>.log`.

Simplification: a replica that dies ends the job (restarting replicas is the fault-tolerance work).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from nebula_rl.config import Config
from nebula_rl.controller.client import TOKEN_ENV
from nebula_rl.controller.redis_server import RedisServer, start_redis

__all__ = ["REDIS_URL_ENV", "launch"]

log = logging.getLogger(__name__)

REDIS_URL_ENV = "NEBULA_REDIS_URL"
"""Environment variable the controller reads the Redis URL (with its password) from."""
_STOP_GRACE_S = 15.0


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    log_file: IO[bytes]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(self.process.pid, sig)


def _start(name: str, argv: list[str], *, env: dict[str, str], logs: Path) -> _Child:
    log_file = (logs / f"{name}.log").open("ab")
    # Own session: a Ctrl-C in the terminal reaches the launcher only, which then stops the
    # children in order instead of all of them dying at once.
    process = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.info("started %s (pid %d), log %s", name, process.pid, logs / f"{name}.log")
    return _Child(name, process, log_file)


def _torchrun(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "nebula_rl.cli",
    ]


class _MetricsTail:
    """Prints the steps the controller appends to `metrics.jsonl`, with the mean reward of the
    last `window` steps (one step's reward is noisy; the trend is what shows learning)."""

    def __init__(self, path: Path, window: int = 20) -> None:
        self.path, self.offset = path, 0
        self.rewards: deque[float] = deque(maxlen=window)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode())
                m = json.loads(line)
                reward = m.get("reward_mean", float("nan"))
                self.rewards.append(reward)
                log.info(
                    "step %d  reward %.3f (last %d: %.3f)  loss %+.4f  staleness %.1f  "
                    "%.2f s/step  %.0f tok/s",
                    m["step"],
                    reward,
                    len(self.rewards),
                    sum(self.rewards) / len(self.rewards),
                    m.get("loss", float("nan")),
                    m.get("staleness_mean", float("nan")),
                    m.get("step_time", float("nan")),
                    m.get("rollout_tokens_per_s", float("nan")),
                )


def launch(
    cfg: Config,
    *,
    run_dir: Path,
    num_policy: int | None = None,
    num_rollout: int | None = None,
) -> int:
    """Run the RL job `cfg` with its controller and replicas as processes; the exit code."""
    from nebula_rl.local import ensure_model

    num_policy = num_policy or cfg.policy.parallelism.n_init_replicas
    num_rollout = num_rollout or cfg.rollout.parallelism.n_init_replicas
    ensure_model(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    config_path = run_dir / "config.json"
    config_path.write_text(cfg.model_dump_json(indent=2))

    redis: RedisServer | None = None
    redis_url = cfg.redis
    if not redis_url:
        redis = start_redis(host="127.0.0.1", data_dir=run_dir / "redis")
        redis_url = redis.url
    from nebula_rl.weights import free_port

    host = cfg.controller.host
    port = cfg.controller.port or free_port(host)
    env = {
        **os.environ,
        TOKEN_ENV: secrets.token_urlsafe(32),
        REDIS_URL_ENV: redis_url,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
    }
    address = f"{host}:{port}"
    children: list[_Child] = []
    stop_signal: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_signal.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    outcome = 1
    try:
        controller = _start(
            "controller",
            [
                sys.executable,
                "-m",
                "nebula_rl.cli",
                "controller",
                "--config",
                str(config_path),
                "--run-dir",
                str(run_dir),
                "--host",
                host,
                "--port",
                str(port),
                "--rollout",
                str(num_rollout),
                "--policy",
                str(num_policy),
            ],
            env=env,
            logs=logs,
        )
        children.append(controller)
        _wait_for_health(controller, address)
        roles = [("policy", i) for i in range(num_policy)]
        roles += [("rollout", i) for i in range(num_rollout)]
        for role, i in roles:
            name = f"{role}-{i}"
            argv = _torchrun(1) + ["replica", "--role", role, "--controller", address]
            children.append(_start(name, [*argv, "--name", name], env=env, logs=logs))
        tail = _MetricsTail(run_dir / "metrics.jsonl")
        outcome = _supervise(controller, children, tail, stop_signal)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop_all(children, graceful=outcome == 0)
        if redis is not None:
            redis.stop()
    if outcome == 0:
        log.info("job finished: %s", run_dir)
    return outcome


def _wait_for_health(controller: _Child, address: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if controller.process.poll() is not None:
            raise RuntimeError(
                f"the controller exited with {controller.process.returncode} while starting; "
                f"see {controller.log_file.name}"
            )
        try:
            if httpx.get(f"http://{address}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the controller did not answer on {address} within {timeout_s:.0f} s")


def _supervise(
    controller: _Child, children: list[_Child], tail: _MetricsTail, stop_signal: list[int]
) -> int:
    """Wait for the controller to end; returns the job's exit code."""
    while True:
        tail.poll()
        if stop_signal:
            log.warning("signal %d: stopping the job", stop_signal[0])
            return 128 + stop_signal[0]
        code = controller.process.poll()
        if code is not None:
            tail.poll()
            if code != 0:
                log.error("the controller failed (exit %d); see %s", code, controller.log_file.name)
            return code
        for child in children:
            code = child.process.poll()
            # A replica leaves with 0 only once the job ended; the controller's exit follows.
            if child is not controller and code:
                log.error(
                    "%s exited with %d before the job ended; see %s",
                    child.name,
                    code,
                    child.log_file.name,
                )
                return 1
        time.sleep(0.2)


def _stop_all(children: list[_Child], *, graceful: bool) -> None:
    """Stop the children: replicas first get time to leave on their own if the job ended well."""
    deadline = time.monotonic() + (_STOP_GRACE_S if graceful else 0.0)
    while graceful and time.monotonic() < deadline:
        if all(c.process.poll() is not None for c in children):
            break
        time.sleep(0.1)
    for child in reversed(children):
        child.stop(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop: killing it", child.name)
            child.stop(signal.SIGKILL)
            child.process.wait()
        child.log_file.close()
