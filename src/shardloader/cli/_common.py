"""Helpers shared by subcommand modules."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardloader.units import parse_size


def size_arg(value: str) -> int:
    """argparse type for byte sizes such as 256MB or 1GiB."""
    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return number


def storage_options_arg(value: str) -> dict[str, Any]:
    """argparse type for --storage-options: a JSON object passed to fsspec."""
    try:
        options = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--storage-options is not valid JSON ({e})") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError("--storage-options must be a JSON object")
    return options


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-options", type=storage_options_arg, default=None, metavar="JSON",
        help='fsspec options for remote URLs, as JSON (e.g. \'{"anon": true}\')',
    )


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar (it is shown on stderr only when that is a terminal)")


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars go to stderr, and only to a terminal, unless --quiet."""
    return not getattr(args, "quiet", False) and sys.stderr.isatty()
