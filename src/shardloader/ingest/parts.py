"""Shards written by many tasks of a distributed engine, committed by one driver.

The contract every engine adapter (`shardloader.spark`, `shardloader.ray`) follows; nothing
here imports an engine. A write has three steps:

1. `begin_write` (driver, once): refuse a destination that holds a dataset (or, with
   `overwrite`, remove its `index.json` first, so no reader sees a dataset from then on), and
   remove manifests a previous, unfinished write left in ``_parts/``.
2. `write_part` (each task, for its partition id p): write the partition's rows as shards named
   ``part-<p>-<k>.<ext>`` (``part-00007-00000.arrow``, with its sidecars), names derived from
   the partition and never from the attempt, so a retried or duplicated attempt overwrites the
   same files (each appears whole: `OutputDir`). Then commit the partition by writing its
   manifest ``_parts/part-<p>.json`` (its shards' index entries and schema), atomically, last.
3. `commit_write` (driver, once every task has committed): read the manifests, check that the
   files they name are there at their recorded sizes, remove the files of failed attempts that
   no manifest names (``part-*`` files and the writer's hidden temporaries), write
   `index.json` once (its appearance is the dataset's), then remove the manifests. Shards are
   listed in partition id order, then shard order, so the same partitions give the same index,
   byte for byte, whichever engine wrote them.

A task killed mid-write leaves at most whole files under its partition's names and no manifest;
its retry rewrites them. A killed attempt that wrote more shards than the retry (a partition
whose content changed between attempts) leaves extra files no manifest names: step 3 removes
them, and `shardloader verify` lists any such file it finds (`verify.unindexed_files`).

Speculative execution (two live attempts of one partition) is safe when a partition's content is
the same in every attempt (then both write the same bytes under the same names); step 3 refuses
an index whose shard sizes differ from the files (attempts that wrote different content).
"""

from __future__ import annotations

import itertools
import json
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa

from shardloader.errors import SchemaError, ShardloaderError
from shardloader.format.index import INDEX_NAME, Index, ShardInfo
from shardloader.format.rows import check_schema
from shardloader.format.schema import arrow_type, batch_records, schema_names
from shardloader.ingest.routing import KEY_FIELDS, in_write_order
from shardloader.ingest.target import OutputDir
from shardloader.ingest.verify import indexed_names
from shardloader.ingest.writer import check_write_options, write_index, write_shard_files
from shardloader.io.clients import filesystem
from shardloader.io.objects import list_directory, read_object, remove_object
from shardloader.io.paths import join_url

PARTS_DIR = "_parts"
MANIFEST_FORMAT = "shardloader-part"
#: Files a partition's task makes: shards and their sidecars, and the writer's local temporaries.
PART_FILE = re.compile(r"\.?part-(\d{5,})-(\d{5,})\.")
MANIFEST_FILE = re.compile(r"part-(\d{5,})\.json")


def part_shard_name(partition: int) -> Callable[[int, str], str]:
    """The shard names of `partition`: number k, extension e -> ``part-<p>-<k>.<e>``."""
    return lambda number, extension: f"part-{partition:05d}-{number:05d}.{extension}"


def write_options(*, shard_bytes: int = 256 << 20, shard_samples: int | None = None,
                  format: str = "arrow", schema: dict[str, str] | None = None,
                  storage_options: dict[str, Any] | None = None,
                  shuffle: bool = False, partitions: int | None = None) -> dict[str, Any]:
    """The options every task of one write gets (a plain dict: engines ship it to tasks),
    checked here on the driver so a bad one fails before any task runs. `partitions`: the
    output partitions a shuffled write asks for (None: the engine's default), checked only."""
    if partitions is not None and (not isinstance(partitions, int) or partitions < 1):
        raise ValueError(f"partitions must be a positive integer or None, got {partitions!r}")
    check_write_options(format, shard_bytes, shard_samples)
    return {"shard_bytes": shard_bytes, "shard_samples": shard_samples, "format": format,
            "schema": dict(schema) if schema is not None else None,
            "storage_options": storage_options, "shuffle": shuffle}


def begin_write(dest: str, *, overwrite: bool = False,
                storage_options: dict[str, Any] | None = None) -> None:
    """Step 1 (driver): refuse an existing dataset unless `overwrite` (then remove its index);
    remove an unfinished write's manifests."""
    with OutputDir(dest, storage_options) as target:
        if target.exists(INDEX_NAME):
            if not overwrite:
                raise ShardloaderError(
                    f"{target.final_path(INDEX_NAME)}: the destination already holds a dataset; "
                    "choose an empty directory or pass overwrite=True")
            target.remove(INDEX_NAME)
    for name in _listing(join_url(dest, PARTS_DIR), storage_options):
        _remove(join_url(dest, PARTS_DIR), name, storage_options)


def write_part(batches: Iterable[pa.RecordBatch | pa.Table], dest: str, partition: int,
               options: dict[str, Any],
               on_shard: Callable[[ShardInfo], None] | None = None) -> dict[str, Any]:
    """Step 2 (a task): write partition `partition`'s rows (Arrow batches) under `dest` and
    commit its manifest; returns the manifest. With `options["shuffle"]`, the batches hold the
    keys of `shardloader.ingest.routing` and are written in their order. `on_shard` is called
    with each shard's entry once its files have appeared (progress, or a test's fault)."""
    if not isinstance(partition, int) or partition < 0:
        raise ValueError(f"partition must be a non-negative integer, got {partition!r}")
    stream: Iterator[pa.RecordBatch] = (
        b for item in batches for b in (item.to_batches() if isinstance(item, pa.Table) else [item]))
    if options["shuffle"]:  # the partition's rows sorted by their keys: held in memory
        stream = iter(in_write_order(list(stream)))
    first = next(stream, None)
    schema = options["schema"]
    if schema is None and first is not None:
        schema = _writable(schema_names(first.schema))
    where = f"{dest}: partition {partition}"
    rows = (record for batch in itertools.chain([first] if first is not None else [], stream)
            for record in batch_records(batch, range(batch.num_rows), where=where))
    with OutputDir(dest, options["storage_options"]) as target:
        written: list[str] = []
        try:
            stored, shards = write_shard_files(
                rows, target, part_shard_name(partition), written,
                shard_bytes=options["shard_bytes"], shard_samples=options["shard_samples"],
                format=options["format"], schema=schema, on_shard=on_shard)
        except SchemaError as e:
            raise type(e)(f"{where}: {e}") from None
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "partition": partition,
                "schema": stored if shards else None,
                "shards": [s.to_json() for s in shards]}
    with OutputDir(join_url(dest, PARTS_DIR), options["storage_options"]) as parts:
        parts.write_bytes(f"part-{partition:05d}.json", json.dumps(manifest, sort_keys=True).encode())
    return manifest


def committed_parts(dest: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The committed manifests under `dest`, in partition id order."""
    parts_url = join_url(dest, PARTS_DIR)
    found = sorted((int(m.group(1)), name) for name in _listing(parts_url, storage_options)
                   if (m := MANIFEST_FILE.fullmatch(name)))
    fs, root = filesystem(parts_url, storage_options, full_interface=True)
    manifests = []
    for partition, name in found:
        manifest = json.loads(read_object(fs, f"{root.rstrip('/')}/{name}", join_url(parts_url, name)))
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("partition") != partition:
            raise ShardloaderError(f"{join_url(parts_url, name)}: not a manifest of partition {partition}")
        manifests.append(manifest)
    return manifests


def commit_write(dest: str, *, storage_options: dict[str, Any] | None = None,
                 shard_table: str = "auto", partitions: Iterable[int] | None = None) -> Index:
    """Step 3 (driver): the index of every committed partition, written once at `dest`.
    `partitions`: the ids the engine reports as done, each of which must have a manifest."""
    manifests = committed_parts(dest, storage_options)
    have = {m["partition"] for m in manifests}
    missing = sorted(set(partitions or ()) - have)
    if missing:
        raise ShardloaderError(f"{dest}: partitions {missing} reported done have no manifest in "
                               f"{PARTS_DIR}/ (written elsewhere, or removed?)")
    schema: dict[str, str] | None = None
    schema_from = -1
    shards: list[ShardInfo] = []
    for manifest in manifests:
        if manifest["schema"] is not None:
            if schema is None:
                schema, schema_from = manifest["schema"], manifest["partition"]
            else:
                check_schema(manifest["schema"], schema, where=(
                    f"{dest}: partitions {schema_from} and {manifest['partition']} have different schemas"))
        shards += [ShardInfo.from_json(e, where=f"{dest}: partition {manifest['partition']}")
                   for e in manifest["shards"]]
    if schema is None:
        raise ShardloaderError(f"{dest}: no samples to write (every partition is empty); no index written")
    index = Index(schema=schema, shards=tuple(shards))
    files = _listing(dest, storage_options, sizes=True)
    for name, size in _recorded_sizes(shards):
        if files.get(name) != size:
            found = "missing" if name not in files else f"{files[name]} bytes"
            raise ShardloaderError(
                f"{join_url(dest, name)}: {found}, but its partition's manifest records {size} "
                "bytes: two attempts of the partition wrote different content (is its input "
                "deterministic?), or the file was removed; nothing was indexed")
    named = indexed_names(index)
    for name in files:
        if PART_FILE.match(name) and name not in named:
            _remove(dest, name, storage_options)
    with OutputDir(dest, storage_options) as target:
        write_index(target, index, shard_table)
    parts_url = join_url(dest, PARTS_DIR)
    fs, root = filesystem(parts_url, storage_options, full_interface=True)
    try:  # the manifests, now in the index; the folder too where folders exist (local)
        remove_object(fs, root, parts_url, recursive=True)
    except FileNotFoundError:
        pass
    return index


def _recorded_sizes(shards: list[ShardInfo]) -> Iterator[tuple[str, int]]:
    """(name, bytes) of every file the shards' entries record: shards and sidecars."""
    for shard in shards:
        yield shard.path, shard.bytes
        for entry in shard.extra.values():
            if isinstance(entry, dict) and "path" in entry and "bytes" in entry:
                yield entry["path"], entry["bytes"]


def _writable(schema: dict[str, str]) -> dict[str, str] | None:
    """`schema` without the routing keys, if the writer stores every type; else None (the
    writer infers types from the first row and names a value it cannot store)."""
    schema = {f: t for f, t in schema.items() if f not in KEY_FIELDS}
    try:
        for name in schema.values():
            arrow_type(name)
    except SchemaError:
        return None
    return schema


def _listing(url: str, storage_options: dict[str, Any] | None, sizes: bool = False) -> Any:
    """Names of the files directly in folder `url` ({name: size} with `sizes`); empty if absent."""
    fs, root = filesystem(url, storage_options, full_interface=True)
    try:
        entries = list_directory(fs, root, url)
    except FileNotFoundError:
        entries = []
    files = {posixpath.basename(e["name"].rstrip("/")): e.get("size") for e in entries
             if e.get("type") == "file"}
    return files if sizes else sorted(files)


def _remove(folder: str, name: str, storage_options: dict[str, Any] | None) -> None:
    fs, root = filesystem(folder, storage_options, full_interface=True)
    try:
        remove_object(fs, f"{root.rstrip('/')}/{name}", join_url(folder, name))
    except FileNotFoundError:
        pass
