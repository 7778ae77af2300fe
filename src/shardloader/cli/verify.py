"""`shardloader verify URL`: recompute every checksum; exit 1 listing each bad file."""

from __future__ import annotations

import argparse

from shardloader.cli._common import add_quiet, add_storage_options, show_progress


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check every shard against the index (presence, size, checksum)",
        description="Check the dataset at URL against its index.json: every shard and tar "
        "sidecar present, of the recorded size and checksum (each file is read once), and for "
        "a local dataset every shard opens with the recorded sample count and schema. Prints "
        "each bad file and exits 1 if any. Also lists shard-like files beside the index that "
        "it does not name (left by a killed or duplicated write task; they take space but "
        "change nothing), without failing.",
    )
    parser.add_argument("url", metavar="URL", help="dataset root (local path or fsspec URL)")
    parser.add_argument("--allow-links-outside-root", action="store_true",
                        help="accept shards that are symbolic links to files outside the root")
    add_quiet(parser)
    add_storage_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardloader.ingest.verify import unindexed_files, verify_dataset
    from shardloader.source.index import load_index

    problems = verify_dataset(args.url, args.storage_options, progress=show_progress(args),
                              allow_links_outside_root=args.allow_links_outside_root)
    unindexed = unindexed_files(args.url, args.storage_options)
    for url in unindexed:
        print(f"UNINDEXED  {url} (not named by the index: a failed write's leftover; remove it)")
    if problems:
        for problem in problems:
            print(f"BAD  {problem}")
        print(f"{len(problems)} problem(s) in {args.url}")
        return 1
    index = load_index(args.url, args.storage_options)
    print(f"ok: {index.num_shards} shards, {index.num_samples} samples, {index.total_bytes} bytes verified")
    return 0
