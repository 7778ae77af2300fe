"""`shardloader index URL`: index a folder of WebDataset tars or Parquet files in place."""

from __future__ import annotations

import argparse

from shardloader.cli._common import add_storage_options


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "index", help="write index.json (and tar offset sidecars) for .tar/.parquet files in place",
    )
    parser.add_argument("url", metavar="URL", help="folder of shards (local path or fsspec URL)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write index.json and sidecars here instead of into URL")
    add_storage_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardloader.format.indexer import index_dataset

    index = index_dataset(args.url, storage_options=args.storage_options, out=args.out)
    formats = sorted({s.format for s in index.shards})
    print(f"indexed {args.url}: {index.num_shards} shards ({', '.join(formats)}), "
          f"{index.num_samples} samples, fingerprint {index.fingerprint}")
    return 0
