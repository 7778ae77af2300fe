"""`shardloader convert SRC DST`: image folders, Parquet, WebDataset tars -> shards."""

from __future__ import annotations

import argparse
import json
import sys

from shardloader.cli._common import positive_int, size_arg
from shardloader.units import format_size


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert an image folder, Parquet files or WebDataset tars into shards",
        description="Convert SRC (an image-class folder SRC/<class>/<file>.jpg|png|..., labelled "
        "as torchvision's ImageFolder does; .parquet file(s), Hugging Face image columns "
        "included; WebDataset .tar file(s); or a shardloader dataset) into shards plus "
        "index.json in DST. Images are checked (empty or undecodable files are named) but "
        "stored as their bytes.",
    )
    parser.add_argument("src", metavar="SRC", help="local file or folder to convert")
    parser.add_argument("dst", metavar="DST", help="output folder (local path or fsspec URL)")
    parser.add_argument("--shard-bytes", type=size_arg, default=256 << 20, metavar="SIZE",
                        help="payload bytes per shard, at most (e.g. 64MB, 1GiB; default 256MiB)")
    parser.add_argument("--shard-samples", type=positive_int, default=None, metavar="N",
                        help="samples per shard, at most")
    parser.add_argument("--format", choices=("arrow", "tar"), default="arrow",
                        help="shard format to write (default: arrow)")
    parser.add_argument("--keep-order", action="store_true",
                        help="write samples in the source order (default: a seeded random order, "
                        "with each sample's source position in the field source_index)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random write order (default: 0)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a dataset already in DST")
    parser.add_argument("--allow-empty", action="store_true",
                        help="image folders: accept class folders without images (their labels "
                        "stay unused, as torchvision's allow_empty)")
    parser.add_argument("-q", "--quiet", "--no-progress", dest="no_progress", action="store_true",
                        help="no progress bar (it is shown on stderr only when that is a terminal)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardloader.ingest.convert import convert

    summary = convert(
        args.src, args.dst, progress=not args.no_progress and sys.stderr.isatty(), shard_bytes=args.shard_bytes,
        shard_samples=args.shard_samples, format=args.format, overwrite=args.overwrite,
        allow_empty=args.allow_empty,
        shuffle=not args.keep_order, seed=args.seed,
    )
    if args.json:
        print(json.dumps(summary, indent=1, ensure_ascii=False))
        return 0
    print(f"converted {summary['source']} ({summary['kind']}) -> {summary['destination']}")
    print(f"  samples  {summary['samples']}")
    print(f"  shards   {summary['shards']} ({summary['format']})")
    print(f"  bytes    {format_size(summary['bytes'])} ({summary['bytes']})")
    order = (f"shuffled (seed {summary['seed']}; source_index holds the source position)"
             if summary["shuffled"] else "source order")
    print(f"  order    {order}")
    print(f"  seconds  {summary['seconds']}")
    if summary["skipped"]:
        shown = ", ".join(summary["skipped"][:5])
        more = f" and {len(summary['skipped']) - 5} more" if len(summary["skipped"]) > 5 else ""
        print(f"  skipped  {len(summary['skipped'])} non-image files: {shown}{more}")
    return 0
