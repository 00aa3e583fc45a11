"""The `nebula-rl` command: its verbs (`main`), the tables it prints and the curves it plots."""

from nebula_rl.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
