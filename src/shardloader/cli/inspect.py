"""`shardloader inspect URL`: what a dataset's index says (no shard is read)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from shardloader.cli._common import add_storage_options
from shardloader.units import format_size


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="show a dataset's samples, shards, bytes, schema and fingerprint",
        description="Show what the index.json of the dataset at URL records: sample and shard "
        "counts, bytes, formats, the schema (field types) and the fingerprint that resume "
        "checks compare. No shard is read.",
    )
    parser.add_argument("url", metavar="URL", help="dataset root (local path or fsspec URL)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--shards", action="store_true", help="also list every shard")
    add_storage_options(parser)
    parser.set_defaults(func=run)


def describe(url: str, storage_options: dict[str, Any] | None, shards: bool) -> dict[str, Any]:
    from shardloader.source.index import load_index

    index = load_index(url, storage_options)
    out: dict[str, Any] = {
        "url": url,
        "samples": index.num_samples,
        "shards": index.num_shards,
        "bytes": index.total_bytes,
        "formats": dict(Counter(s.format for s in index.shards)),
        "fingerprint": index.fingerprint,
        "schema": dict(index.schema),
    }
    if shards:
        out["shard_list"] = [
            {"path": s.path, "format": s.format, "samples": s.samples, "bytes": s.bytes}
            for s in index.shards
        ]
    return out


def run(args: argparse.Namespace) -> int:
    info = describe(args.url, args.storage_options, args.shards)
    if args.json:
        print(json.dumps(info, indent=1, ensure_ascii=False))
        return 0
    formats = ", ".join(f"{n} {fmt}" for fmt, n in info["formats"].items())
    print(f"dataset      {info['url']}")
    print(f"samples      {info['samples']}")
    print(f"shards       {info['shards']} ({formats})")
    print(f"bytes        {format_size(info['bytes'])} ({info['bytes']})")
    print(f"fingerprint  {info['fingerprint']}")
    print("schema")
    width = max((len(name) for name in info["schema"]), default=0)
    for name, type_name in info["schema"].items():
        print(f"  {name:<{width}}  {type_name}")
    for shard in info.get("shard_list", []):
        print(f"  {shard['path']}  {shard['format']}  {shard['samples']} samples  {shard['bytes']} bytes")
    return 0
