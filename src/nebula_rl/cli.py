"""The `nebula-rl` command.

    nebula-rl check --config FILE         validate a config and print it resolved
    nebula-rl train --config FILE         train (single process for now)

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


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if args.output_dir:
        cfg.train.output_dir = args.output_dir
    if args.max_num_steps:
        cfg.train.max_num_steps = args.max_num_steps
    # Co-located processes on few cores slow each other down badly with several threads each.
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    from nebula_rl import local

    try:
        run_dir = local.run(cfg)
    except ValueError as err:
        logging.getLogger("nebula_rl").error("%s", err)
        return 2
    logging.getLogger("nebula_rl").info("run finished: %s", run_dir)
    return 0


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

    train = sub.add_parser("train", help="run a training job")
    train.add_argument("--config", required=True, help="TOML config file")
    train.add_argument("--output-dir", help="override train.output_dir")
    train.add_argument("--max-num-steps", type=int, help="override train.max_num_steps")
    train.set_defaults(func=_cmd_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `nebula-rl` console script."""
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
