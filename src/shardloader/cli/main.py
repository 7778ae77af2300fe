"""The `shardloader` command line.

Subcommands are modules of this package, found at start-up: every module in
`shardloader/cli/` (except `main` and names starting with `_`) that defines
`register(subparsers)` is a subcommand. To add one (e.g. `cache`, `report`), add a module::

    # src/shardloader/cli/report.py
    def register(subparsers):
        parser = subparsers.add_parser("report", help="...")
        parser.add_argument(...)
        parser.set_defaults(func=run)

    def run(args) -> int:       # the exit status
        ...

No other file changes. Keep module-level imports light (import heavy libraries inside `run`),
because every subcommand module is imported for every invocation, `--help` included.
A `ShardloaderError` raised by `run` prints as ``shardloader <cmd>: error: <message>`` and
exits 1; argument errors exit 2 (argparse).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from shardloader._version import __version__
from shardloader.errors import ShardloaderError


def subcommand_modules() -> list[ModuleType]:
    """The modules of this package that define a subcommand, sorted by module name."""
    package = importlib.import_module("shardloader.cli")
    names = sorted(
        m.name for m in pkgutil.iter_modules(package.__path__)
        if m.name != "main" and not m.name.startswith("_")
    )
    modules = [importlib.import_module(f"shardloader.cli.{name}") for name in names]
    return [m for m in modules if callable(getattr(m, "register", None))]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardloader",
        description="Sharded datasets: convert, index, inspect and verify them.",
    )
    parser.add_argument("--version", action="version", version=f"shardloader {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in subcommand_modules():
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ShardloaderError as e:
        print(f"shardloader {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shardloader {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
