"""The launcher: the only place that starts processes, and the entry of a replica's processes.

`launch(cfg, ...)` runs a whole RL job on this machine:

1. builds the warm-start model if the config asks for one and it is missing;
2. starts Redis (a private server with a password, unless `redis` names an external one);
3. starts the controller (`nebula-rl controller`), then each replica (`nebula-rl replica`, which
   starts the replica's ranks with :func:`run_ranks`): policy replicas first, then rollout
   replicas;
4. supervises: prints each training step as the controller records it, forwards SIGINT/SIGTERM
   to every child, and stops everything when the controller ends.

Failures: a replica that dies is logged and left out; the controller notices (heartbeats),
rebuilds the groups among the survivors and re-issues the lost work, so the job goes on while a
replica of each role lives: one the launcher started, or one started by hand with `nebula-rl
replica` (which may join at any time). A controller killed by a signal is restarted on the same
port, token and Redis (up to `max_controller_restarts` times) and continues the job from Redis;
one that exits with an error ends the job.

It returns 0 only when the controller finished the job. Secrets (the job's token, the Redis URL
with its password) reach the children through their environment, never their command line.
Each process logs to `<run>/logs/<name>.log`.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from nebula_rl.config import Config
from nebula_rl.controller.client import (
    REDIS_URL_ENV,
    RESTART_ENV,
    TOKEN_ENV,
    TOKEN_FILE,
    ControllerClient,
)
from nebula_rl.controller.redis_server import RedisServer, start_redis
from nebula_rl.launch.forking import (
    ForkedProcess,
    die_with_parent,
    fork_command,
    why_not_fork,
)
from nebula_rl.modality import for_config
from nebula_rl.utils.metrics_log import MetricsLogger, check_installed, open_loggers
from nebula_rl.utils.runs import write_private
from nebula_rl.utils.signals import forward_checkpoint_signals

__all__ = [
    "Placement",
    "check_job",
    "ensure_model",
    "launch",
    "plan_placement",
    "replica_nproc",
    "run_ranks",
]

log = logging.getLogger(__name__)

_STOP_GRACE_S = 15.0


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes] | ForkedProcess
    log_file: IO[bytes]
    role: str = ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(self.process.pid, sig)


_CLI = [sys.executable, "-m", "nebula_rl.cli"]


def _start(
    name: str,
    argv: list[str],
    *,
    env: dict[str, str],
    logs: Path,
    role: str = "",
    may_fork: bool = False,
) -> _Child:
    """Start `argv` with its output in `<logs>/<name>.log`. With `may_fork`, a `nebula-rl`
    command runs in a fork of this process where that is safe (:mod:`nebula_rl.launch.forking`: torch
    already loaded), else in a new interpreter."""
    log_file = (logs / f"{name}.log").open("ab")
    # Own session: a Ctrl-C in the terminal reaches the launcher only, which then stops the
    # children in order instead of all of them dying at once.
    process: subprocess.Popen[bytes] | ForkedProcess
    if may_fork and argv[:3] == _CLI and why_not_fork(env) is None:
        process = fork_command(argv, env=env, name=name, output=log_file.fileno(), new_session=True)
    else:
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    how = "forked" if isinstance(process, ForkedProcess) else "pid"
    log.info("started %s (%s %d), log %s", name, how, process.pid, logs / f"{name}.log")
    return _Child(name, process, log_file, role)


@dataclass(frozen=True)
class Placement:
    """Where one replica runs: its processes (ranks) and, on GPUs, their devices."""

    role: str
    """"policy" or "rollout"."""
    index: int
    """The replica's number within its role (its name is `<role>-<index>`)."""
    nproc: int
    """Ranks of the replica: the product of its `[<role>.parallelism]` sizes."""
    devices: tuple[int, ...] = ()
    """GPU ids given to it (CUDA_VISIBLE_DEVICES); empty on CPU."""

    @property
    def name(self) -> str:
        """`<role>-<index>`."""
        return f"{self.role}-{self.index}"


def plan_placement(
    cfg: Config, *, num_policy: int, num_rollout: int, num_gpus: int, num_teacher: int = 0
) -> list[Placement]:
    """The replicas of an RL job and their ranks; with `num_gpus` > 0, their GPUs (policy
    replicas first, then rollout, then distillation teacher replicas, one rank each). A layout
    that needs more GPUs than there are is refused, naming the keys.

    `mode = "disaggregated"`: disjoint GPUs for every replica; `policy.parallelism.dp_shard_size
    = -1` takes the GPUs the rollout replicas leave, split evenly over the policy replicas.
    `mode = "colocated_separated"`: the policy replicas get disjoint GPUs, and each rollout
    replica shares one policy replica's: rollout replica `i` goes to policy replica `i mod
    num_policy`, and the `k`-th rollout replica on one policy replica (`k = i // num_policy`)
    takes slice `k mod (policy ranks // rollout ranks)` of its GPUs, so two rollout replicas on
    a policy replica of twice their size sit side by side. A rollout replica must fit in one
    policy replica (`rollout.parallelism.tp_size * pp_size` <= the policy's ranks);
    `dp_shard_size = -1` then splits all GPUs over the policy replicas.

    On CPU (`num_gpus` = 0) ranks are processes without devices, in either mode, and
    `dp_shard_size = -1` is 1."""

    policy, rollout = cfg.policy.parallelism, cfg.rollout.parallelism
    colocated = cfg.mode == "colocated_separated"
    rollout_world = rollout.tp_size * rollout.pp_size
    policy_world = policy.world_size
    if policy_world is None:  # dp_shard_size = -1
        others = policy.pp_size * policy.dp_replicate_size * policy.cp_size * policy.tp_size
        taken = 0 if colocated else num_rollout * rollout_world
        left = (num_gpus - taken) // num_policy if num_gpus else others
        if left < others or left % others:
            raise ValueError(
                f"policy.parallelism.dp_shard_size = -1: the {num_gpus} GPUs less the rollout "
                f"replicas' {taken} leave {max(left, 0)} per policy replica, not a multiple of "
                f"pp_size * dp_replicate_size * cp_size * tp_size ({others})"
            )
        policy_world = left
    plan = [Placement("policy", i, policy_world) for i in range(num_policy)]
    plan += [Placement("rollout", i, rollout_world) for i in range(num_rollout)]
    if colocated and num_teacher:
        raise ValueError(
            'mode = "colocated_separated" places no distillation teacher replicas yet; use '
            'mode = "disaggregated" with distillation.enable'
        )
    plan += [Placement("teacher", i, 1) for i in range(num_teacher)]
    if not num_gpus:
        return plan
    if colocated:
        return _colocate(plan, num_policy=num_policy, num_gpus=num_gpus)
    need = sum(p.nproc for p in plan)
    if need > num_gpus:
        raise ValueError(
            f"the layout needs {need} GPUs ({num_policy} policy replica(s) x {policy_world} "
            f"(policy.parallelism) + {num_rollout} rollout replica(s) x {rollout_world} "
            f"(rollout.parallelism.tp_size * pp_size) + {num_teacher} teacher replica(s) "
            f"(distillation.parallelism)) and this machine has {num_gpus}"
        )
    placed, start = [], 0
    for p in plan:
        placed.append(Placement(p.role, p.index, p.nproc, tuple(range(start, start + p.nproc))))
        start += p.nproc
    return placed


def _colocate(plan: list[Placement], *, num_policy: int, num_gpus: int) -> list[Placement]:
    """`plan_placement` for `mode = "colocated_separated"` on `num_gpus` GPUs: disjoint GPUs
    for the policy replicas, and every rollout replica on a slice of one policy replica's."""
    policies, rollouts = plan[:num_policy], plan[num_policy:]
    policy_world = policies[0].nproc if policies else 0
    need = num_policy * policy_world
    if need > num_gpus:
        raise ValueError(
            f'mode = "colocated_separated": the layout needs {need} GPUs ({num_policy} policy '
            f"replica(s) x {policy_world} (policy.parallelism); the rollout replicas share "
            f"them) and this machine has {num_gpus}"
        )
    rollout_world = rollouts[0].nproc if rollouts else 0
    if rollout_world > policy_world:
        raise ValueError(
            f'mode = "colocated_separated": a rollout replica '
            f"(rollout.parallelism.tp_size * pp_size = {rollout_world}) must fit in the GPUs of "
            f"one policy replica (policy.parallelism: {policy_world})"
        )
    placed = [
        Placement(p.role, p.index, p.nproc, tuple(range(i * p.nproc, (i + 1) * p.nproc)))
        for i, p in enumerate(policies)
    ]
    slices = policy_world // rollout_world if rollouts else 1
    for r in rollouts:
        host = placed[r.index % num_policy].devices
        start = (r.index // num_policy) % slices * rollout_world
        placed.append(Placement(r.role, r.index, r.nproc, host[start : start + rollout_world]))
    return placed


def launched_ranks(cfg: Config, role: str, ranks: int) -> int:
    """Processes nebula-rl starts for a replica of `role` and `ranks` ranks: one for a vLLM
    rollout replica (vLLM starts its own tensor- and pipeline-parallel workers on the
    replica's devices), else one per rank."""
    return 1 if role == "rollout" and cfg.rollout.backend == "vllm" else ranks


def replica_nproc(cfg: Config, role: str, *, num_gpus: int) -> int:
    """Processes of one replica of `role` started on its own (`nebula-rl replica`): its
    parallel sizes (`launched_ranks`); a policy's `dp_shard_size = -1` takes all `num_gpus` (1
    on CPU)."""
    if role == "rollout":
        ranks = cfg.rollout.parallelism.tp_size * cfg.rollout.parallelism.pp_size
        return launched_ranks(cfg, role, ranks)
    if role == "teacher":  # (a split teacher is refused where it loads)
        return 1
    return plan_placement(cfg, num_policy=1, num_rollout=0, num_gpus=num_gpus)[0].nproc


_RANK_POLL_S = 0.1


def thread_env(
    cfg: Config, placement: list[Placement], env: dict[str, str], *, cores: int
) -> dict[str, str]:
    """What the replicas' environment gains for their torch threads: `OMP_WAIT_POLICY=PASSIVE`
    when their threads together (`policy.cpu_threads`, `rollout.cpu_threads`, else
    `OMP_NUM_THREADS` each) outnumber `cores`, unless `env` sets a wait policy already.

    OpenMP's threads spin at the end of each parallel region before they sleep; with more
    threads than cores, one process's spinning threads take the core another process's thread
    needs. Measured on 2 cores, the GSM8K-shaped job in bf16 (policy 2 threads, rollout 1): 1.9
    ms of step time per token passive against 2.4 spinning (BENCHMARKS.md)."""
    default = int(env.get("OMP_NUM_THREADS", "1"))
    per_role = {"policy": cfg.policy.cpu_threads, "rollout": cfg.rollout.cpu_threads}
    threads = sum(place.nproc * (per_role.get(place.role) or default) for place in placement)
    if threads <= cores or "OMP_WAIT_POLICY" in env:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def run_ranks(argv: list[str], nproc: int, *, grace_s: float = _STOP_GRACE_S) -> int:
    """Run `argv` as `nproc` ranks on this host and supervise them, as torchrun would; the exit
    code: 0 when every rank exited with 0, else the first failure's (128 + signal when one was
    killed).

    The ranks meet in a `FileStore` in a private temporary folder (:mod:`nebula_rl.utils.ranks`), so no
    port is opened for them. When one rank fails, the others get SIGTERM and, `grace_s` later,
    SIGKILL: a replica never keeps running with a rank missing (its peers would hang in their
    next collective). SIGINT, SIGTERM and SIGUSR1/2 sent to this process are passed on to every
    rank.
    """
    import tempfile

    from nebula_rl.utils.ranks import RANKS_ENV

    folder = tempfile.mkdtemp(prefix="nebula-ranks-")  # (mode 0700)
    base = {
        **os.environ,
        RANKS_ENV: os.path.join(folder, "store"),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
    }
    ranks: list[subprocess.Popen[bytes] | ForkedProcess] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        for process in ranks:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    relayed = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    previous = {s: signal.signal(s, forward) for s in relayed}
    code = 0
    try:
        for rank in range(nproc):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            if argv[:3] == _CLI and why_not_fork(env) is None:  # (nebula_rl.launch.forking)
                replica = argv[argv.index("--name") + 1] if "--name" in argv else "rank"
                name = f"{replica}:{rank}"
                ranks.append(fork_command(argv, env=env, name=name, die_with_parent=True))
            else:
                ranks.append(
                    subprocess.Popen(
                        argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent
                    )
                )
        while code == 0:
            codes = [p.poll() for p in ranks]  # (every rank: `any` would stop at the first)
            if all(c is not None for c in codes):
                break
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                code = failed[0]
            time.sleep(_RANK_POLL_S)
        if code == 0:
            code = next((p.returncode for p in ranks if p.returncode), 0)
        if code != 0:
            log.warning("a rank exited with %d: stopping the other ranks", code)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + grace_s
        for process in ranks:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return 128 - code if code < 0 else code


class _MetricsTail:
    """Hands the steps the controller appends to `metrics.jsonl` to the terminal's sinks (the
    console: a line per step with the recent mean reward, and a progress bar)."""

    def __init__(self, path: Path, loggers: MetricsLogger) -> None:
        self.path, self.offset, self.loggers = path, 0, loggers

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode())
                self.loggers.log(json.loads(line))


def launch(
    cfg: Config,
    *,
    run_dir: Path,
    num_policy: int | None = None,
    num_rollout: int | None = None,
    num_teacher: int | None = None,
    max_controller_restarts: int = 3,
) -> int:
    """Run the RL job `cfg` with its controller and replicas as processes; the exit code.
    Teacher replicas (`num_teacher`, else `distillation.parallelism.n_init_replicas`) start
    only with `distillation.enable`."""
    num_policy, num_rollout, num_teacher = _replica_counts(
        cfg, num_policy, num_rollout, num_teacher
    )
    placement = _prepare(cfg, run_dir, num_policy, num_rollout, num_teacher)
    logs, config_path = run_dir / "logs", run_dir / "config.json"
    redis: RedisServer | None = None
    redis_url = cfg.redis
    if not redis_url:
        redis = start_redis(host="127.0.0.1", data_dir=run_dir / "redis")
        redis_url = redis.url
    from nebula_rl.utils.net import free_port

    host = cfg.controller.host
    port = cfg.controller.port or free_port(host)
    env = {
        **os.environ,
        TOKEN_ENV: secrets.token_urlsafe(32),
        REDIS_URL_ENV: redis_url,
        "PYTHONUNBUFFERED": "1",
    }
    address = f"{host}:{port}"
    # For `nebula-rl status --run-dir`; the controller writes its address next to it.
    write_private(run_dir / TOKEN_FILE, env[TOKEN_ENV])
    children: list[_Child] = []
    stop_signal: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_signal.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    outcome = 1
    try:
        controller_argv = [
            *_CLI, "controller", "--config", str(config_path), "--run-dir", str(run_dir),
            "--host", host, "--port", str(port), "--rollout", str(num_rollout),
            "--policy", str(num_policy),
        ]  # fmt: skip

        def start_controller(*, restart: bool) -> _Child:
            extra = {RESTART_ENV: "1"} if restart else {}
            child = _start("controller", controller_argv, env={**env, **extra}, logs=logs)
            try:
                _wait_for_health(child, address)
            except RuntimeError:
                child.stop(signal.SIGKILL)
                child.process.wait()
                child.log_file.close()
                raise
            return child

        controller = start_controller(restart=False)
        children.append(controller)
        # A scheduler's pre-emption signal (train.save_ckpt_at_exit): a checkpoint after the
        # next step, through the controller; the job goes on.
        forward_checkpoint_signals(cfg.train, lambda: _request_checkpoint(address, env[TOKEN_ENV]))
        _start_replicas(cfg, placement, address, env, logs, into=children)
        total_steps = _total_steps(address, env[TOKEN_ENV])
        with open_loggers(cfg, run_dir, total_steps=total_steps, only={"console"}) as loggers:
            tail = _MetricsTail(run_dir / "metrics.jsonl", loggers)
            outcome = _supervise(
                children,
                tail,
                stop_signal,
                restart_controller=lambda: start_controller(restart=True),
                max_restarts=max_controller_restarts,
                registered=functools.partial(_registered, address, env[TOKEN_ENV]),
            )
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop_all(children, graceful=outcome == 0)
        if redis is not None:
            redis.stop()
    if outcome == 0:
        log.info("job finished: %s", run_dir)
    return outcome


def _prepare(
    cfg: Config, run_dir: Path, num_policy: int, num_rollout: int, num_teacher: int
) -> list[Placement]:
    """Before anything starts: the checks, the warm-start model, the replicas' placement and
    thread settings, the run folder with its `logs/` and `config.json`."""
    if cfg.train.resume is False and not cfg.redis and (run_dir / "redis").is_dir():
        # (its Redis would reopen with that job's state: a finished job's replicas stop at once)
        raise ValueError(
            f"train.timestamp = {run_dir.name!r}: {run_dir} holds an earlier job of that name "
            "(its controller state in redis/): set train.resume = true to continue it from its "
            "last checkpoint, or give this run another train.timestamp"
        )
    check_installed(cfg.logging.logger)
    ensure_model(cfg)
    placement = plan_placement(
        cfg,
        num_policy=num_policy,
        num_rollout=num_rollout,
        num_teacher=num_teacher,
        num_gpus=_gpu_count(),
    )
    # The replicas' OpenMP settings (they inherit this environment) are this process's too,
    # before its checks load torch (whose OpenMP runtime reads them once): the replicas forked
    # from it then run with them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(thread_env(cfg, placement, dict(os.environ), cores=_cores()))
    check_job(cfg)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return placement


def _replica_counts(
    cfg: Config, num_policy: int | None, num_rollout: int | None, num_teacher: int | None
) -> tuple[int, int, int]:
    """Policy, rollout and teacher replicas to start: the flags', else the config's."""
    num_policy = num_policy or cfg.policy.parallelism.n_init_replicas
    if cfg.mode == "colocated":  # every policy replica generates: no rollout replicas
        if num_rollout:
            raise ValueError(
                f'--rollout {num_rollout}: mode = "colocated" starts no rollout replicas (each '
                "policy replica generates on its own ranks); scale with --policy"
            )
        num_rollout = 0
    else:
        num_rollout = num_rollout or cfg.rollout.parallelism.n_init_replicas
    num_teacher = (
        (num_teacher or cfg.distillation.parallelism.n_init_replicas)
        if cfg.distillation.enable
        else 0
    )
    return num_policy, num_rollout, num_teacher


def _start_replicas(
    cfg: Config,
    placement: list[Placement],
    address: str,
    env: dict[str, str],
    logs: Path,
    *,
    into: list[_Child],
) -> None:
    """Start every placed replica, forked where it can be (each on its devices), into `into`
    as each starts (so that a failed start stops those already running)."""
    for place in placement:
        argv = [*_CLI, "replica", "--role", place.role]
        nproc = launched_ranks(cfg, place.role, place.nproc)
        argv += ["--controller", address, "--name", place.name, "--nproc", str(nproc)]
        devices = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, place.devices))}
        child_env = {**env, **devices} if place.devices else env
        into.append(
            _start(place.name, argv, env=child_env, logs=logs, role=place.role, may_fork=True)
        )


def _gpu_count() -> int:
    """The CUDA devices torch sees; 0 without loading torch on a machine with no GPU device."""
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ensure_model(cfg: Config) -> None:
    """Build the policy's starting model with `policy.warmstart_config` if it is not on disk yet:
    that config runs as a job of its own (`nebula-rl train --config ...`, its output in its own
    run folder and log), and must export to `policy.model_name_or_path`."""
    path, warm = cfg.policy.model_name_or_path, cfg.policy.warmstart_config
    if warm is None or path.startswith("tiny:") or Path(path).exists():
        return
    log.info("%s is missing: building it with the warm-start config %s", path, warm)
    argv = [*_CLI, "train", "--config", warm]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"policy.warmstart_config {warm} failed (exit {done.returncode}); its output is above"
        )
    if not Path(path).exists():
        raise ValueError(
            f"policy.warmstart_config {warm} ran but did not produce policy.model_name_or_path {path}"
        )


def check_job(cfg: Config) -> None:
    """Raise, before any process starts, the errors a replica would otherwise hit only once the
    job runs: a model that is neither a local model folder, a Hub id that can be fetched, nor a
    preset, a rollout backend that cannot run here, and policy parallel sizes that cannot run
    (pipeline micro-batches, CP without CUDA). A Hub model is fetched into the Hugging Face
    cache here, once, so that the replicas find it there."""

    for_config(cfg).check_job(cfg)


def _request_checkpoint(address: str, token: str) -> None:
    client = ControllerClient(address, token, timeout=10.0)
    try:
        client.request_checkpoint()
    finally:
        client.close()


def _total_steps(address: str, token: str) -> int:
    """The job's number of steps, as the controller computed it from the dataset."""
    client = ControllerClient(address, token)
    try:
        return int(client.meta()["total_steps"])
    finally:
        client.close()


def _registered(address: str, token: str, role: str) -> int:
    """How many replicas of `role` the controller has registered (also those started by hand);
    -1 when it cannot be asked (e.g. it is restarting) or the job has ended (its replicas leave
    while the controller finishes; its exit code is the job's)."""
    import httpx

    client = ControllerClient(address, token, timeout=5.0)
    try:
        status = client.status()
    except httpx.HTTPError:
        return -1
    finally:
        client.close()
    if status["finished"] is not None:
        return -1
    return sum(info["role"] == role for info in status["replicas"].values())


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
    children: list[_Child],
    tail: _MetricsTail,
    stop_signal: list[int],
    *,
    restart_controller: Callable[[], _Child],
    max_restarts: int,
    registered: Callable[[str], int],
) -> int:
    """Wait for the controller (`children[0]`) to end; returns the job's exit code.

    A controller killed by a signal is restarted (it replaces `children[0]`); a replica that
    fails is logged and left out. When every replica of a role that the launcher started has
    failed, the job goes on only while the controller still has one of that role registered
    (`registered(role)`: e.g. started by hand).
    """
    failed: set[str] = set()
    restarts = 0
    roles = {child.role for child in children[1:]}
    next_ask = 0.0
    while True:
        tail.poll()
        if stop_signal:
            log.warning("signal %d: stopping the job", stop_signal[0])
            return 128 + stop_signal[0]
        controller = children[0]
        code = controller.process.poll()
        if code is not None and code < 0 and restarts < max_restarts:
            restarts += 1
            log.warning(
                "the controller was killed by signal %d: restarting it (%d of at most %d)",
                -code,
                restarts,
                max_restarts,
            )
            controller.log_file.close()
            children[0] = restart_controller()
            continue
        if code is not None:
            tail.poll()
            if code != 0:
                log.error("the controller failed (exit %d); see %s", code, controller.log_file.name)
            return code
        for child in children[1:]:
            code = child.process.poll()
            # A replica leaves with 0 only once the job ended; the controller's exit follows.
            if code and child.name not in failed:
                failed.add(child.name)
                log.warning(
                    "%s exited with %d; the job goes on without it (see %s)",
                    child.name,
                    code,
                    child.log_file.name,
                )
        gone = [r for r in roles if all(c.name in failed for c in children[1:] if c.role == r)]
        if gone and time.monotonic() >= next_ask:
            next_ask = time.monotonic() + 1.0
            for role in gone:
                if registered(role) == 0:
                    log.error("no %s replica is left: ending the job", role)
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
