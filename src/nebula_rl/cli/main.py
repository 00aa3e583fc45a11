"""The `nebula-rl` command.

    nebula-rl check --config FILE [--policy N] [--rollout M]
                                                    validate a config, print the values in
                                                    force and what a job would find here
    nebula-rl train --config FILE [--policy N] [--rollout M] [--teacher T] [--local]
                                                    run a job (RL: controller + replicas)
    nebula-rl controller --config FILE              only the controller (multi-node)
    nebula-rl replica --role R --controller H:P     one replica (it starts its ranks itself)
    nebula-rl slurm --config FILE --nodes N [--submit]
                                                    an sbatch script running the job on N nodes
    nebula-rl status | replica ls | replica show N  inspect a running job (tables)
    nebula-rl plot RUN_DIR [--out FILE]             reward and length curves as a PNG
    nebula-rl config-reference [--write|--check F]  the config reference, from config.py
    nebula-rl reward-service --config FILE          the world-model reward service (HTTP)

Heavy modules (torch, transformers) are imported inside the commands that need them, so
`--help` and `check` stay fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nebula_rl import __version__
from nebula_rl.modality import for_config

if TYPE_CHECKING:
    from nebula_rl.config import Config

__all__ = ["main"]


def _setup_logging(level: str) -> None:
    from rich.logging import RichHandler

    # (the ranks of a replica share its log file)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank {os.environ.get('RANK', '0')}] " if world_size > 1 else ""
    logging.basicConfig(
        level=level.upper(),
        format=prefix + "%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(show_path=False, rich_tracebacks=False)],
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise


def _load(path: str):
    from nebula_rl.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _cmd_check(args: argparse.Namespace) -> int:
    """Validate, print the values in force (JSON on stdout), then what `train` would find: notes
    and errors on stderr; exit 2 when the job cannot run."""
    from nebula_rl.launch.preflight import preflight

    cfg = _load(args.config)
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    found = preflight(cfg, num_policy=args.policy, num_rollout=args.rollout)
    for note in [*cfg.warnings, *found.notes]:
        print(f"note: {note}", file=sys.stderr)
    for error in found.errors:
        print(f"error: {args.config}: {error}", file=sys.stderr)
    return 2 if found.errors else 0


def _setup_torch() -> None:
    # Co-located processes on few cores slow each other down badly with several threads each.
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)


def _preload() -> None:
    """torch and transformers' modelling code loaded once here, where this process starts
    several ranks: they start as forks of it that have them (nebula_rl.launch.forking)."""
    _setup_torch()
    import transformers.modeling_utils  # noqa: F401


class _RunLogHandler(logging.FileHandler):
    """A file log in the run folder, created (with the folder) by nebula-rl's first record: a
    job refused before it starts leaves no run folder behind. Other libraries' records (import-
    time warnings, e.g. torchao's when transformers imports it) wait in memory until the file
    exists, so they do not create it."""

    _MAX_HELD = 1000

    def __init__(self, path: Path) -> None:
        super().__init__(path, delay=True)
        self._held: list[logging.LogRecord] = []

    def _open(self):  # type: ignore[no-untyped-def]
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()

    def emit(self, record: logging.LogRecord) -> None:
        waiting = self.stream is None and not Path(self.baseFilename).parent.exists()
        if waiting and not record.name.startswith("nebula_rl"):
            if len(self._held) < self._MAX_HELD:
                self._held.append(record)
            return
        held, self._held = self._held, []
        for earlier in held:
            super().emit(earlier)
        super().emit(record)


def _file_log(path: Path) -> tuple[logging.Logger, logging.Handler]:
    """Send every log record (and the tracebacks the returned logger takes) to `path` too; the
    console keeps its short lines. Returns that logger and the file's handler."""
    handler = _RunLogHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    trace = logging.getLogger("nebula_rl.traceback")
    trace.propagate = False
    trace.addHandler(handler)
    return trace, handler


def _wait_for_model(path: str, timeout_s: float = 3600.0) -> None:
    """Ranks other than 0 wait for rank 0's warm start (`ensure_model`) to have written `path`."""
    import time

    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"policy.model_name_or_path {path} did not appear")
        time.sleep(1.0)


def _sft_nproc(cfg: Config) -> int:
    """Ranks of an SFT job's policy (`[policy.parallelism]`; `dp_shard_size = -1` takes every
    visible GPU, 1 on CPU)."""
    from nebula_rl.launch import replica_nproc
    from nebula_rl.utils.devices import visible_gpus

    return replica_nproc(cfg, "policy", num_gpus=visible_gpus() or 0)


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if args.output_dir:
        cfg.train.output_dir = args.output_dir
    if args.max_num_steps:
        cfg.train.max_num_steps = args.max_num_steps
    if args.timestamp:
        cfg.train.timestamp = args.timestamp
    from nebula_rl.config import GrpoConfig
    from nebula_rl.launch import run_ranks
    from nebula_rl.utils.ranks import RANKS_ENV
    from nebula_rl.utils.runs import resolve_run_dir

    modality = for_config(cfg)
    p = cfg.train.train_policy
    # (uncentralized colocated RL samples and trains on the policy's ranks, in this job)
    distributed = isinstance(p, GrpoConfig) and not args.local and not p.uncentralized_training
    if not distributed:
        try:
            modality.check_single(cfg)  # (before any rank starts)
        except ValueError as err:
            logging.getLogger("nebula_rl").error("%s", err)
            return 2
    first = RANKS_ENV not in os.environ and "WORLD_SIZE" not in os.environ  # (of the job)
    if first:
        if not _fetch_uploaded(cfg, controller=distributed):
            return 2
        from nebula_rl.data.shards import unpack_datasets

        try:  # (WebDataset shards: streamed once into the cache, where every process reads)
            unpack_datasets(cfg)
        except ValueError as err:
            logging.getLogger("nebula_rl").error("%s", err)
            return 2
    if not distributed and first:
        nproc = _sft_nproc(cfg)
        if nproc > 1:  # this process supervises the ranks that split the policy
            _preload()
            argv = [sys.executable, "-m", "nebula_rl.cli", *args.argv]
            # (every rank writes in one run folder: fix its name now)
            return run_ranks([*argv, "--timestamp", resolve_run_dir(cfg.train).name], nproc)
    _setup_torch()
    from nebula_rl.launch import ensure_model

    log = logging.getLogger("nebula_rl")
    rank = int(os.environ.get("RANK", "0"))
    run_dir = resolve_run_dir(cfg.train)
    trace, file_log = _file_log(
        run_dir / "logs" / (f"train-rank{rank}.log" if rank else "train.log")
    )
    try:
        if rank == 0:
            ensure_model(cfg)
        elif cfg.policy.warmstart_config is not None:
            _wait_for_model(cfg.policy.model_name_or_path)
        if not distributed:  # SFT, RL with --local, uncentralized colocated RL
            run_dir = modality.run_single(cfg)
            log.info("run finished: %s", run_dir)
            return 0
        from nebula_rl.launch import launch

        return launch(
            cfg,
            run_dir=run_dir,
            num_policy=args.policy,
            num_rollout=args.rollout,
            num_teacher=args.teacher,
        )
    except Exception as err:
        code = 2 if isinstance(err, ValueError) else 1
        if not run_dir.exists():  # refused before anything started: no run folder, no log file
            logging.getLogger().removeHandler(file_log)
            if code == 2:  # what the user got wrong; the message names the key
                log.error("%s", err)
            else:
                log.exception("nebula-rl train failed before the job started")
            return code
        # The whole traceback goes to the run's log; the console gets one line that says where.
        trace.exception("nebula-rl train failed")
        where = run_dir / "logs" / (f"train-rank{rank}.log" if rank else "train.log")
        log.error("%s: %s (traceback in %s)", type(err).__name__, err, where)
        return code


def _fetch_uploaded(cfg: Config, *, controller: bool) -> bool:
    """`train.ckpt.upload_s3`: check that the bucket answers, and with `resume = true` on a
    machine that holds no checkpoint of the run, fetch the newest from it
    (`fetch_s3_checkpoint`; `controller`: a job of replicas); False (logged) if the storage
    refused."""
    from nebula_rl.utils.object_store import StorageError
    from nebula_rl.utils.runs import fetch_s3_checkpoint

    log = logging.getLogger("nebula_rl")
    try:
        fetched = fetch_s3_checkpoint(cfg.train, controller=controller)
    except StorageError as err:
        log.error("%s", err)
        return False
    if fetched is not None:
        log.info("resuming from the uploaded %s", fetched)
    return True


def _cmd_controller(args: argparse.Namespace) -> int:
    import secrets

    from nebula_rl.controller.client import (
        ADDRESS_FILE,
        REDIS_URL_ENV,
        TOKEN_ENV,
        TOKEN_FILE,
    )
    from nebula_rl.controller.run import run_controller
    from nebula_rl.utils.net import free_port
    from nebula_rl.utils.runs import resolve_run_dir, write_private

    cfg = _load(args.config)
    log = logging.getLogger("nebula_rl")
    if args.run_dir:  # (the run folder of this job: where it resumes from, too)
        cfg.train.output_dir, cfg.train.timestamp = (
            str(Path(args.run_dir).parent),
            Path(args.run_dir).name,
        )
    if not _fetch_uploaded(cfg, controller=True):
        return 2
    run_dir = resolve_run_dir(cfg.train)
    run_dir.mkdir(parents=True, exist_ok=True)
    token = os.environ.get(TOKEN_ENV, "")
    if not token:  # started by hand: make a token and leave it where only this user can read it
        token = secrets.token_urlsafe(32)
        write_private(run_dir / TOKEN_FILE, token)
        log.info(
            "job token written to %s (give it to replicas as %s)", run_dir / TOKEN_FILE, TOKEN_ENV
        )
    host = args.host or cfg.controller.host
    port = cfg.controller.port if args.port is None else args.port
    port = port or free_port(host)  # chosen here so that the address file can name it
    (run_dir / ADDRESS_FILE).write_text(f"{host}:{port}\n")
    redis = None
    redis_url = os.environ.get(REDIS_URL_ENV) or cfg.redis
    if not redis_url:
        from nebula_rl.controller.redis_server import start_redis

        # On the controller's interface (replicas on other hosts reach both), with a password;
        # a wildcard address would hand replicas a URL they cannot dial.
        if host in ("0.0.0.0", "::", ""):
            log.error(
                "--host %r: the job's Redis binds to the controller's address and replicas dial "
                "it, so give one address (e.g. this node's), or start Redis yourself and set %s",
                host,
                REDIS_URL_ENV,
            )
            return 2
        redis = start_redis(host=host, data_dir=run_dir / "redis")
        redis_url = redis.url
    try:
        run_controller(
            cfg,
            run_dir=run_dir,
            redis_url=redis_url,
            token=token,
            host=host,
            port=port,
            num_rollout=args.rollout or cfg.rollout.parallelism.n_init_replicas,
            num_policy=args.policy or cfg.policy.parallelism.n_init_replicas,
            job_rows=for_config(cfg).job_rows(cfg, run_dir),
        )
    except ValueError as err:
        log.error("%s", err)
        return 2
    finally:
        if redis is not None:
            redis.stop()
    return 0


def _cmd_replica(args: argparse.Namespace) -> int:
    if args.replica_command is not None:  # `replica ls` / `replica show NAME`
        return _inspect(args)
    if args.role is None or args.controller is None:
        args.parser.error("starting a replica needs --role and --controller (or use ls / show)")
    import socket

    from nebula_rl.launch.replica import exit_now, run_replica
    from nebula_rl.utils.ranks import RANKS_ENV

    name = args.name or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    if RANKS_ENV not in os.environ and "WORLD_SIZE" not in os.environ:  # not a rank yet
        nproc = args.nproc or _replica_nproc(args.role, args.controller)
        if nproc > 1:  # this process supervises the replica's ranks
            from nebula_rl.launch import run_ranks

            argv = [sys.executable, "-m", "nebula_rl.cli", "replica", "--role", args.role]
            argv += ["--controller", args.controller, "--name", name]
            return run_ranks(argv, nproc)
    _setup_torch()
    try:
        code = run_replica(args.role, controller=args.controller, name=name)
    except Exception:
        logging.getLogger("nebula_rl").exception("replica %s failed", name)
        code = 1
    exit_now(code)
    return code


def _replica_nproc(role: str, controller: str) -> int:
    """Ranks of a replica of `role` in the job at `controller`, from the job's parallel sizes
    and this machine's visible GPUs."""
    from nebula_rl.config import config_from_dict
    from nebula_rl.controller.client import ControllerClient, read_token
    from nebula_rl.launch import replica_nproc
    from nebula_rl.utils.devices import visible_gpus

    client = ControllerClient(controller, read_token())
    try:
        meta = client.meta()
    finally:
        client.close()
    cfg = config_from_dict(meta["config"], source=f"{controller}/api/meta")
    return replica_nproc(cfg, role, num_gpus=visible_gpus() or 0)


def _connection(args: argparse.Namespace) -> tuple[str, str]:
    """(HOST:PORT, token) of the controller to inspect: flags, then the environment, then the
    files a job leaves in its run folder (`--run-dir`)."""

    from nebula_rl.controller.client import ADDRESS_FILE, CONTROLLER_ENV, TOKEN_ENV, TOKEN_FILE

    run_dir = Path(args.run_dir) if args.run_dir else None

    def from_run_dir(name: str) -> str:
        path = run_dir / name if run_dir is not None else None
        return path.read_text().strip() if path is not None and path.is_file() else ""

    address = args.controller or os.environ.get(CONTROLLER_ENV) or from_run_dir(ADDRESS_FILE)
    token = args.token or os.environ.get(TOKEN_ENV) or from_run_dir(TOKEN_FILE)
    if not address:
        raise ValueError(
            f"name the controller: --controller HOST:PORT, {CONTROLLER_ENV}, or --run-dir RUN"
        )
    if not token:
        raise ValueError(f"give the job's token: {TOKEN_ENV}, --token, or --run-dir RUN")
    return address, token


def _inspect(args: argparse.Namespace) -> int:
    """`status`, `replica ls` and `replica show NAME`: ask the controller, print tables (or
    JSON with `--json`)."""
    import httpx
    from rich.console import Console

    from nebula_rl.cli import tables
    from nebula_rl.controller.client import ControllerClient

    try:
        address, token = _connection(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    client = ControllerClient(address, token)
    try:
        if args.command == "status":
            total_steps = client.meta().get("total_steps")
            data: Any = {**client.status(), "total_steps": total_steps}
            data["replicas"] = client.replicas()  # with heartbeat ages
            views = tables.status_tables(data)
        elif args.replica_command == "ls":
            data = client.replicas()
            views = [tables.replicas_table(data)]
        else:
            data = client.replica(args.name)
            views = [tables.replica_table(data)]
    except httpx.HTTPStatusError as err:
        code = err.response.status_code
        reason = {
            401: "the controller refused the token",
            404: f"no replica named {getattr(args, 'name', '')!r} is registered",
        }.get(code, err.response.text)
        print(f"error: {address}: {reason} (HTTP {code})", file=sys.stderr)
        return 1
    except httpx.HTTPError as err:
        print(f"error: cannot reach the controller at {address}: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    console = Console()
    for view in views:
        console.print(view)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:

    from nebula_rl.cli.plot import plot_run

    try:
        out = plot_run(Path(args.run_dir), out=Path(args.out) if args.out else None)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """`eval` and `generate`: one model, or (`eval --run`) each export of a training run."""
    from nebula_rl.eval import evaluate, load_eval_config, run_checkpoints

    try:
        ec = load_eval_config(args.config, num_gpus=args.num_gpus)
        if args.output_dir:
            ec.evaluation.output_dir = args.output_dir
        if args.command == "generate":
            evaluate(ec, model=args.model, score=False)
            print(Path(ec.evaluation.output_dir) / "samples.jsonl")
            return 0
        if args.run:
            for row in run_checkpoints(ec, args.run):
                print(json.dumps(row))
            print(Path(ec.evaluation.output_dir) / "scores.csv")
            return 0
        print(json.dumps(evaluate(ec, model=args.model), indent=2))
    except (ValueError, RuntimeError) as err:  # (ConfigError is a ValueError)
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _cmd_config_reference(args: argparse.Namespace) -> int:

    from nebula_rl.config import reference as config_reference

    if args.write is None and args.check is None:
        print(config_reference.render(), end="")
        return 0
    path = Path(args.write or args.check)
    try:
        current = config_reference.is_current(path)
        if args.check is not None:
            if not current:
                print(
                    f"error: the config reference in {path} is out of date; regenerate it with "
                    f"`nebula-rl config-reference --write {path}`",
                    file=sys.stderr,
                )
            return 0 if current else 1
        if not current:
            config_reference.write(path)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{path}: config reference {'up to date' if current else 'updated'}")
    return 0


def _cmd_slurm(args: argparse.Namespace) -> int:
    """Render the job's sbatch script to --out (or stdout); with --submit, submit it and print
    the job id. A layout or flag that cannot run exits 2, naming it."""
    from nebula_rl.launch.slurm import SlurmJob, render_sbatch, submit

    cfg = _load(args.config)
    job = SlurmJob(
        config_path=Path(args.config).resolve(),
        num_nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        num_policy=args.policy,
        num_rollout=args.rollout,
        partition=args.partition or "",
        account=args.account or "",
        time=args.time or "",
        job_name=args.job_name,
        output_dir=Path(args.output_dir).resolve() if args.output_dir else None,
        port=args.port,
        workdir=Path.cwd(),
    )
    try:
        script = render_sbatch(cfg, job)
    except ValueError as err:
        print(f"error: {args.config}: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    if out is None and args.submit:  # sbatch reads a file
        out = Path(job.output_dir or cfg.train.output_dir) / f"{job.job_name}.sbatch"
    if out is None:
        print(script, end="")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(script)
    # (Slurm writes its log there and does not create the folder)
    Path(job.output_dir or cfg.train.output_dir).mkdir(parents=True, exist_ok=True)
    print(f"wrote {out}", file=sys.stderr)
    if args.submit:
        try:
            print(submit(out))
        except (OSError, RuntimeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return 0


def _cmd_reward_service(args: argparse.Namespace) -> int:
    """Serve the world-model reward service until SIGINT or SIGTERM, then stop its workers
    (docs/reward-service.md); a bad config or a port in use exits 2, naming the key, workers
    that cannot start exit 1."""
    from nebula_rl.rewards.service import load_service_config, run_service

    try:
        cfg = load_service_config(args.config)
        if args.host:
            cfg.host = args.host
        if args.port is not None:
            cfg.port = args.port
        run_service(cfg)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # no worker could start (its output is above)
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def _add_connection_flags(parser: argparse.ArgumentParser, *, address: bool = True) -> None:
    """--controller, --token, --run-dir, --json for the inspection commands."""
    if address:
        parser.add_argument(
            "--controller", help="HOST:PORT of the controller (default: $NEBULA_CONTROLLER)"
        )
    parser.add_argument("--token", help="the job's token (default: $NEBULA_TOKEN)")
    parser.add_argument(
        "--run-dir", help="the job's run folder: read its token and controller address files"
    )
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead")


def _add_replica_counts(parser: argparse.ArgumentParser) -> None:
    """The initial replica counts, overriding the config's (`train`, `slurm`)."""
    parser.add_argument(
        "--policy", type=int, help="policy replicas (policy.parallelism.n_init_replicas)"
    )
    parser.add_argument(
        "--rollout", type=int, help="rollout replicas (rollout.parallelism.n_init_replicas)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for the CLI reference in the docs)."""
    parser = argparse.ArgumentParser(prog="nebula-rl", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"nebula-rl {__version__}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_job_commands(sub)
    _add_run_commands(sub)
    _add_other_commands(sub)
    return parser


def _add_job_commands(sub: Any) -> None:
    """`check`, `train`, `controller`, `replica` (and `replica ls` / `show`)."""
    check = sub.add_parser(
        "check",
        help="validate a config, print the values in force, and what a job would find here "
        "(paths, Hub ids, layout)",
    )
    check.add_argument("--config", required=True, help="TOML config file")
    check.add_argument("--policy", type=int, help="policy replicas (as for train)")
    check.add_argument("--rollout", type=int, help="rollout replicas (as for train)")
    check.set_defaults(func=_cmd_check)

    train = sub.add_parser(
        "train", help="run a training job (RL: Redis, controller and replicas as processes)"
    )
    train.add_argument("--config", required=True, help="TOML config file")
    train.add_argument("--output-dir", help="override train.output_dir")
    train.add_argument("--max-num-steps", type=int, help="override train.max_num_steps")
    train.add_argument(
        "--timestamp", help="override train.timestamp (the run folder's name under output_dir)"
    )
    _add_replica_counts(train)
    train.add_argument(
        "--teacher",
        type=int,
        help="distillation teacher replicas (distillation.parallelism.n_init_replicas)",
    )
    train.add_argument(
        "--local", action="store_true", help="RL in this one process instead (no controller)"
    )
    train.set_defaults(func=_cmd_train)

    controller = sub.add_parser("controller", help="run only the controller of a job")
    controller.add_argument("--config", required=True, help="TOML (or resolved .json) config")
    controller.add_argument("--run-dir", help="run folder (default: train.output_dir/<time>)")
    controller.add_argument("--host", help="interface to serve on (controller.host)")
    controller.add_argument("--port", type=int, help="port (controller.port; 0: any free)")
    controller.add_argument("--rollout", type=int, help="rollout replicas the job waits for")
    controller.add_argument(
        "--policy", type=int, help="policy replicas (data parallel) the job waits for"
    )
    controller.set_defaults(func=_cmd_controller)

    replica = sub.add_parser(
        "replica",
        help="run one replica (its ranks as processes of this host); `replica ls` / "
        "`replica show NAME` inspect a running job's replicas",
    )
    replica.add_argument(
        "--role", choices=["policy", "rollout", "teacher"], help="start a replica of it"
    )
    replica.add_argument("--controller", help="the controller's HOST:PORT")
    replica.add_argument("--name", help="unique replica name (default: role-host-pid)")
    replica.add_argument(
        "--nproc",
        type=int,
        help="ranks of the replica (default: from the job's [policy|rollout.parallelism] and "
        "the visible GPUs)",
    )
    replica.set_defaults(func=_cmd_replica, parser=replica)
    inspect = replica.add_subparsers(dest="replica_command", metavar="{ls,show}")
    ls = inspect.add_parser("ls", help="list the replicas of a running job")
    show = inspect.add_parser("show", help="one replica's registry entry and heartbeat stats")
    show.add_argument("name", help="replica name (as `replica ls` lists it)")
    for p in (ls, show):
        # `--controller` may come before or after `ls`: default SUPPRESS keeps the earlier one.
        p.add_argument("--controller", default=argparse.SUPPRESS, help="HOST:PORT")
        _add_connection_flags(p, address=False)


def _add_run_commands(sub: Any) -> None:
    """`slurm`, `status`, `plot`: a job on a cluster, a running job, a finished run."""
    slurm = sub.add_parser(
        "slurm",
        help="write (and with --submit, submit) an sbatch script that runs the RL job on the "
        "nodes of a Slurm allocation: controller and Redis on the first, replicas by their GPUs",
    )
    slurm.add_argument("--config", required=True, help="TOML config file")
    slurm.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    slurm.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs of a node (default 8; 0: CPU ranks)"
    )
    slurm.add_argument("--partition", help="Slurm partition")
    slurm.add_argument("--account", help="Slurm account")
    slurm.add_argument("--time", help="time limit (Slurm's format, e.g. 04:00:00)")
    slurm.add_argument("--job-name", default="nebula-rl", help="Slurm job name")
    slurm.add_argument(
        "--output-dir", help="override train.output_dir (the run folder and Slurm's log go there)"
    )
    _add_replica_counts(slurm)
    slurm.add_argument(
        "--port", type=int, default=0, help="controller port (default: controller.port, else free)"
    )
    slurm.add_argument("--out", help="write the script to this file (default: stdout)")
    slurm.add_argument(
        "--submit",
        action="store_true",
        help="submit it with sbatch and print the job id (default file: "
        "<output_dir>/<job name>.sbatch)",
    )
    slurm.set_defaults(func=_cmd_slurm)

    status = sub.add_parser("status", help="where a running job stands (step, ledger, replicas)")
    _add_connection_flags(status)
    status.set_defaults(func=_inspect, replica_command=None)

    plot = sub.add_parser("plot", help="reward and response-length curves of a run as a PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="run folder holding metrics.jsonl")
    plot.add_argument("--out", help="PNG file to write (default: RUN_DIR/curves.png)")
    plot.set_defaults(func=_cmd_plot)


def _add_other_commands(sub: Any) -> None:
    """`eval`, `generate`, `config-reference`, `reward-service`."""
    for name, text in (
        ("eval", "score a model (or, with --run, each checkpoint of a run) on a dataset: "
                 "mean reward and pass@k over num_gpus / tp_size engine shards"),
        ("generate", "batch inference: a model's completions of a dataset's prompts as JSONL"),
    ):  # fmt: skip
        command = sub.add_parser(name, help=text)
        command.add_argument("--config", required=True, help="eval TOML (docs/evaluation.md)")
        command.add_argument("--num-gpus", "--num_gpus", type=int, dest="num_gpus",
                             help="override num_gpus (devices, or processes on CPU; "
                             "--num_gpus is the seed's spelling)")  # fmt: skip
        command.add_argument("--model", help="override [model] model_name")
        command.add_argument("--output-dir", help="override evaluation.output_dir")
        if name == "eval":
            command.add_argument("--run", metavar="RUN_DIR",
                                 help="evaluate each safetensors/step_N and final of a run")  # fmt: skip
        command.set_defaults(func=_cmd_eval, run=None)

    reference = sub.add_parser(
        "config-reference", help="the config reference (every key, type, default, meaning)"
    )
    target = reference.add_mutually_exclusive_group()
    target.add_argument("--write", metavar="FILE", help="update it between the markers of FILE")
    target.add_argument(
        "--check", metavar="FILE", help="exit 1 if FILE's copy is out of date, change nothing"
    )
    reference.set_defaults(func=_cmd_config_reference)

    reward_service = sub.add_parser(
        "reward-service",
        help="serve the world-model reward service (cosmos-rl's protocol) until SIGINT/SIGTERM",
    )
    reward_service.add_argument(
        "--config", required=True, help="reward-service TOML (e.g. configs/rewards.toml)"
    )
    reward_service.add_argument("--host", help="interface to listen on (overrides host)")
    reward_service.add_argument(
        "--port", type=int, help="port to listen on (overrides port; 0: any free one)"
    )
    reward_service.set_defaults(func=_cmd_reward_service)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `nebula-rl` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    _setup_logging(args.log_level)
    return args.func(args)
