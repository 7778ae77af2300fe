"""`shardloader cache verify|info|prune DIR`: look after a node's shard cache directory.

`verify` re-hashes every cached shard and range sidecar against the checksum its name records
and exits 1 listing each bad file (`--remove` deletes them, under their download lock, so the
next reader fetches them again). `info` prints what the cache holds. `prune` evicts least
recently used shards and range sidecars that no process is reading until at most `--to` bytes
remain (`--to 0` empties it).
All are safe while training processes use the cache.
"""

from __future__ import annotations

import argparse
import os

from shardloader.cli._common import size_arg
from shardloader.errors import ShardloaderError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cache", help="verify, inspect or prune a node's shard cache",
        description="Look after a node's shard cache directory (a Dataset's cache_dir). Safe "
        "while training processes use the cache.",
    )
    actions = parser.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    verify = actions.add_parser(
        "verify", help="re-hash every cached shard; exit 1 if any is bad",
        description="Re-hash every cached shard against the checksum its name records; list "
        "each bad file and exit 1 if any (--remove deletes them so they are fetched again).",
    )
    verify.add_argument("dir", metavar="DIR", help="the cache directory (cache_dir)")
    verify.add_argument("--remove", action="store_true", help="delete the bad files")
    verify.add_argument("-v", "--verbose", action="store_true", help="list good files too")
    verify.set_defaults(func=run_verify)
    info = actions.add_parser("info", help="size and number of cached shards",
                              description="Print how many shards the cache holds and their size, "
                              "and the bytes of downloads in progress.")
    info.add_argument("dir", metavar="DIR", help="the cache directory (cache_dir)")
    info.set_defaults(func=run_info)
    prune = actions.add_parser(
        "prune", help="evict unpinned shards, least recently used first",
        description="Evict shards no process is reading, least recently used first, until at "
        "most --to bytes remain (--to 0 empties the cache).",
    )
    prune.add_argument("dir", metavar="DIR", help="the cache directory (cache_dir)")
    prune.add_argument("--to", type=size_arg, required=True, metavar="SIZE",
                       help="bytes to keep at most, e.g. 50GB or 0")
    prune.set_defaults(func=run_prune)


def _open(directory: str):
    from shardloader.cache.store import ShardCache

    if not all(os.path.isdir(os.path.join(directory, d)) for d in ("data", "index", "locks", "tmp")):
        raise ShardloaderError(f"{directory}: not a shardloader cache directory (no data/, index/, locks/, tmp/)")
    return ShardCache(directory, limit=1 << 62)


def run_verify(args: argparse.Namespace) -> int:
    from shardloader.cache.maintenance import verify_all

    cache = _open(args.dir)
    good = bad = 0
    for path, status, detail in verify_all(cache, remove=args.remove):
        if status == "ok":
            good += 1
            if args.verbose:
                print(f"ok   {path}")
        else:
            bad += 1
            print(f"BAD  {path}: {detail}")
    cache.close()
    print(f"{good} ok, {bad} bad in {args.dir}")
    return 1 if bad else 0


def run_info(args: argparse.Namespace) -> int:
    from shardloader.cache.maintenance import usage as cache_usage
    from shardloader.units import format_size

    cache = _open(args.dir)
    usage = cache_usage(cache)
    cache.close()
    sidecars = f" and {usage['sidecars']} range sidecars" if usage["sidecars"] else ""
    print(f"{args.dir}: {usage['files']} shards{sidecars}, {format_size(usage['data_bytes'])} "
          f"({usage['data_bytes']} bytes), {format_size(usage['tmp_bytes'])} in downloads in progress")
    return 0


def run_prune(args: argparse.Namespace) -> int:
    from shardloader.cache.maintenance import prune
    from shardloader.units import format_size

    cache = _open(args.dir)
    result = prune(cache, args.to)
    cache.close()
    sidecars = result["evicted_sidecars"]
    also = f" and {sidecars} range sidecars" if sidecars else ""
    print(f"evicted {result['evicted'] - sidecars} shards{also} ({format_size(result['bytes_freed'])}); "
          f"{format_size(result['remaining'])} remain")
    return 0
