"""`shardloader index URL`: index a folder of WebDataset tars or Parquet files in place."""

from __future__ import annotations

import argparse
import os

from shardloader.cli._common import add_quiet, add_storage_options, show_progress
from shardloader.errors import ShardloaderError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "index", help="write index.json (and tar offset sidecars) for .tar/.parquet files in place",
        description="Index the WebDataset .tar and .parquet files directly in folder URL so that "
        "they are read in place: checksum each file, count its samples, write an offsets sidecar "
        "<name>.tar.idx per tar and index.json last. The files themselves are not changed.",
    )
    parser.add_argument("url", metavar="URL", help="folder of shards (local path or fsspec URL)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write index.json and sidecars here instead of into URL")
    parser.add_argument("--shard-table", choices=("auto", "json", "table"), default="auto",
                        help="list the shards in index.json (json) or in an Arrow table beside it "
                        "(table: opens fast at 10^6 shards); auto: the table above 10,000 shards")
    add_quiet(parser)
    add_storage_options(parser)
    parser.set_defaults(func=run)


def check_folder(url: str) -> None:
    """A ShardloaderError with the command to run when local `url` is not a folder of shards."""
    if "://" in url and not url.startswith("file://"):
        return
    path = url[len("file://"):] if url.startswith("file://") else url
    parent = os.path.dirname(path.rstrip("/")) or "."
    if os.path.isfile(path):
        raise ShardloaderError(
            f"{url} is a file; `shardloader index` takes the folder that holds the .tar/.parquet "
            f"files: `shardloader index {parent}`"
        )
    if os.path.isdir(path) and not any(n.endswith((".tar", ".parquet")) for n in os.listdir(path)):
        from shardloader.format.roots import root_hint

        hint = root_hint(url)
        if os.path.exists(os.path.join(path, "index.json")):
            hint = " (it already holds a shardloader dataset: `shardloader inspect " + url + "`)"
        raise ShardloaderError(f"{url}: no .tar or .parquet files to index{hint}")


def run(args: argparse.Namespace) -> int:
    from shardloader.ingest.indexer import index_dataset

    check_folder(args.url)
    index = index_dataset(args.url, storage_options=args.storage_options, out=args.out,
                          progress=show_progress(args), shard_table=args.shard_table)
    formats = sorted({s.format for s in index.shards})
    print(f"indexed {args.url}: {index.num_shards} shards ({', '.join(formats)}), "
          f"{index.num_samples} samples, fingerprint {index.fingerprint}")
    return 0
