"""`shardloader verify URL`: recompute every checksum; exit 1 listing each bad file."""

from __future__ import annotations

import argparse

from shardloader.cli._common import add_storage_options


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check every shard against the index (presence, size, checksum)",
    )
    parser.add_argument("url", metavar="URL", help="dataset root (local path or fsspec URL)")
    add_storage_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardloader.format.verify import verify_dataset
    from shardloader.source import load_index

    problems = verify_dataset(args.url, args.storage_options)
    if problems:
        for problem in problems:
            print(f"BAD  {problem}")
        print(f"{len(problems)} problem(s) in {args.url}")
        return 1
    index = load_index(args.url, args.storage_options)
    print(f"ok: {index.num_shards} shards, {index.num_samples} samples, {index.total_bytes} bytes verified")
    return 0
