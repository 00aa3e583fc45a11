"""The `nebula-rl` command.

    nebula-rl check --config FILE                   validate a config and print it resolved
    nebula-rl train --config FILE [--policy N] [--rollout M] [--local]
                                                    run a job (RL: controller + replicas)
    nebula-rl controller --config FILE              only the controller (multi-node)
    nebula-rl replica --role R --controller H:P     one replica process (under torchrun)

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

from nebula_rl import __version__

__all__ = ["main"]


def _setup_logging(level: str) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=level.upper(),
        format="%(message)s",
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
    cfg = _load(args.config)
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


def _setup_torch() -> None:
    # Co-located processes on few cores slow each other down badly with several threads each.
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if args.output_dir:
        cfg.train.output_dir = args.output_dir
    if args.max_num_steps:
        cfg.train.max_num_steps = args.max_num_steps
    _setup_torch()
    from nebula_rl import local
    from nebula_rl.config import GrpoConfig

    log = logging.getLogger("nebula_rl")
    distributed = isinstance(cfg.train.train_policy, GrpoConfig) and not args.local
    try:
        if not distributed:
            run_dir = local.run(cfg)
            log.info("run finished: %s", run_dir)
            return 0
        from nebula_rl.launch import launch

        return launch(
            cfg, run_dir=local.run_dir_for(cfg), num_policy=args.policy, num_rollout=args.rollout
        )
    except ValueError as err:
        log.error("%s", err)
        return 2
    except RuntimeError as err:  # a process of the job failed to start; its log is named
        log.error("%s", err)
        return 1


def _cmd_controller(args: argparse.Namespace) -> int:
    import secrets
    from pathlib import Path

    from nebula_rl.controller.client import TOKEN_ENV
    from nebula_rl.controller.scheduler import run_controller
    from nebula_rl.launch import REDIS_URL_ENV
    from nebula_rl.local import run_dir_for

    cfg = _load(args.config)
    _setup_torch()
    log = logging.getLogger("nebula_rl")
    run_dir = Path(args.run_dir) if args.run_dir else run_dir_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    token = os.environ.get(TOKEN_ENV, "")
    if not token:  # started by hand: make a token and leave it where only this user can read it
        token = secrets.token_urlsafe(32)
        token_file = run_dir / "token"
        token_file.touch(mode=0o600)
        token_file.write_text(token)
        log.info("job token written to %s (give it to replicas as %s)", token_file, TOKEN_ENV)
    redis = None
    redis_url = os.environ.get(REDIS_URL_ENV) or cfg.redis
    if not redis_url:
        from nebula_rl.controller.redis_server import start_redis

        redis = start_redis(host="127.0.0.1", data_dir=run_dir / "redis")
        redis_url = redis.url
    try:
        run_controller(
            cfg,
            run_dir=run_dir,
            redis_url=redis_url,
            token=token,
            host=args.host or cfg.controller.host,
            port=cfg.controller.port if args.port is None else args.port,
            num_rollout=args.rollout or cfg.rollout.parallelism.n_init_replicas,
            num_policy=args.policy or cfg.policy.parallelism.n_init_replicas,
        )
    except ValueError as err:
        log.error("%s", err)
        return 2
    finally:
        if redis is not None:
            redis.stop()
    return 0


def _cmd_replica(args: argparse.Namespace) -> int:
    import socket

    from nebula_rl.replica import exit_now, run_replica

    _setup_torch()
    name = args.name or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    try:
        code = run_replica(args.role, controller=args.controller, name=name)
    except Exception:
        logging.getLogger("nebula_rl").exception("replica %s failed", name)
        code = 1
    exit_now(code)
    return code


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for the CLI reference in the docs)."""
    parser = argparse.ArgumentParser(prog="nebula-rl", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"nebula-rl {__version__}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="validate a config file and print it resolved")
    check.add_argument("--config", required=True, help="TOML config file")
    check.set_defaults(func=_cmd_check)

    train = sub.add_parser(
        "train", help="run a training job (RL: Redis, controller and replicas as processes)"
    )
    train.add_argument("--config", required=True, help="TOML config file")
    train.add_argument("--output-dir", help="override train.output_dir")
    train.add_argument("--max-num-steps", type=int, help="override train.max_num_steps")
    train.add_argument(
        "--policy", type=int, help="policy replicas (policy.parallelism.n_init_replicas)"
    )
    train.add_argument(
        "--rollout", type=int, help="rollout replicas (rollout.parallelism.n_init_replicas)"
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

    replica = sub.add_parser("replica", help="run one replica process (under torchrun)")
    replica.add_argument("--role", required=True, choices=["policy", "rollout"])
    replica.add_argument("--controller", required=True, help="the controller's HOST:PORT")
    replica.add_argument("--name", help="unique replica name (default: role-host-pid)")
    replica.set_defaults(func=_cmd_replica)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `nebula-rl` console script."""
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
