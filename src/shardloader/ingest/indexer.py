"""Indexing existing `.tar` (WebDataset) and `.parquet` files in place.

`index_dataset(url)` lists the directory (not recursive), takes its `.tar` and `.parquet`
files sorted by name as the shards, computes each checksum while streaming the file once,
counts samples (tar: a header scan; Parquet: the footer), writes an offsets sidecar
``<name>.tar.idx`` per tar and a range sidecar ``<name>.ranges`` per shard (see
`shardloader.format.ranges`), and writes `index.json` last. Remote files are streamed into a
local temporary file (one read) and scanned there. All shards must share one schema.

Remote folders are listed and read through the process's client of `shardloader.io.clients`
with the shard cache's retries (`shardloader.io.objects`): transient errors are retried with
backoff, a permanent one (403, a shard gone between listing and reading) raises FetchError
naming the URL.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
from collections.abc import Iterator
from typing import Any

import pyarrow.parquet as pq
from tqdm.auto import tqdm

from shardloader.errors import SchemaError, ShardError, ShardloaderError
from shardloader.format.index import Index, ShardInfo
from shardloader.format.ranges import RANGES_KEY, ranges_entry, ranges_path
from shardloader.format.registry import FORMATS, table_of_file
from shardloader.format.rows import check_schema
from shardloader.format.schema import schema_names
from shardloader.format.tar import OFFSETS_KEY, TarOffsets, offsets_entry, scan_tar, sidecar_path
from shardloader.ingest.target import OutputDir, discard
from shardloader.ingest.writer import write_index
from shardloader.io.checksum import checksum_file, format_checksum, new_hasher
from shardloader.io.clients import filesystem
from shardloader.io.objects import list_directory, object_size, read_chunks
from shardloader.io.paths import is_local, join_url

INDEXABLE = {f.suffix: f.name for f in FORMATS.values() if f.indexable}


def list_shard_files(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Names (relative to `url`) of the `.tar`/`.parquet` files directly in `url`, sorted."""
    fs, root = filesystem(url, storage_options, full_interface=True)
    try:
        entries = list_directory(fs, root, url)
    except FileNotFoundError:
        raise ShardloaderError(f"{url}: directory not found") from None
    names = [
        posixpath.basename(e["name"].rstrip("/"))
        for e in entries
        if e.get("type") == "file" and e["name"].endswith(tuple(INDEXABLE))
    ]
    return sorted(names)


@contextlib.contextmanager
def _local_copy(fs: Any, path: str, url: str, local: bool) -> Iterator[tuple[str, str, int]]:
    """(local path, checksum, size) of the file at `path` (`url` names it in errors): itself
    when local, else a temporary copy made while hashing it (one read of the remote object)."""
    if local:
        checksum, size = checksum_file(path)
        yield path, checksum, size
        return
    hasher = new_hasher()
    fd, temp = tempfile.mkstemp(prefix="shardloader-index-", suffix=os.path.splitext(path)[1])
    try:
        size = 0
        with os.fdopen(fd, "wb") as dst:
            for chunk in read_chunks(fs, path, url, object_size(fs, path, url)):
                hasher.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        yield temp, format_checksum("xxh3_128", hasher.hexdigest()), size
    finally:
        discard(temp)


def _tar_entry(fs: Any, path: str, url: str, local: bool) -> tuple[str, int, TarOffsets, bytes]:
    """Checksum, size, member table and range sidecar of one tar, reading a remote one once."""
    with _local_copy(fs, path, url, local) as (copy, checksum, size):
        table = scan_tar(copy, name=path)
        return checksum, size, table, _ranges(copy, "tar", path, table.spans)


def _ranges(copy: str, fmt: str, name: str, tar_spans: Any = None) -> bytes:
    try:
        return table_of_file(copy, fmt, tar_spans).encode()
    except ShardloaderError:
        raise
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise ShardError(f"{name}: cannot map its rows to byte ranges (corrupt?): {e}") from None


def _parquet_entry(fs: Any, path: str, url: str, local: bool) -> tuple[str, int, int, int, dict[str, str], bytes]:
    """Checksum, size, rows, row groups, schema and range sidecar of one Parquet file."""
    with _local_copy(fs, path, url, local) as (copy, checksum, size):
        try:
            meta = pq.ParquetFile(copy)
            rows, groups = meta.metadata.num_rows, meta.metadata.num_row_groups
            schema = schema_names(meta.schema_arrow)
        except Exception as e:  # pyarrow raises several types for a damaged footer
            raise ShardError(f"{path}: not a readable Parquet file (truncated or corrupt?): {e}") from None
        return checksum, size, rows, groups, schema, _ranges(copy, "parquet", path)


def index_dataset(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = False,
    shard_table: str = "auto",
) -> Index:
    """Build `index.json` (and tar sidecars) for the shard files in directory `url`.

    `shard_table`: where the shards are listed, as for `write_shards` ("auto": in an Arrow
    table beside index.json above 10,000 shards; "json"; "table").

    `out` is where index.json and the sidecars are written, default `url` itself. `progress`
    shows a progress bar (one step per shard) on stderr. Raises
    SchemaError naming both shards when two shards' schemas differ, ShardError for an
    unreadable file, ShardloaderError when there is nothing to index.
    """
    url = os.fspath(url)
    names = list_shard_files(url, storage_options)
    if not names:
        raise ShardloaderError(f"{url}: no .tar or .parquet files to index")
    fs, root = filesystem(url, storage_options, full_interface=True)
    local = is_local(url)
    shards: list[ShardInfo] = []
    schema: dict[str, str] | None = None
    schema_from = ""
    with OutputDir(os.fspath(out) if out is not None else url, storage_options) as target:
        for name in tqdm(names, desc=f"indexing {url}", unit="shard", disable=not progress):
            path = posixpath.join(root, name) if not local else os.path.join(root, name)
            where = join_url(url, name)
            fmt = INDEXABLE[os.path.splitext(name)[1]]
            extra: dict[str, Any] = {}
            if fmt == "tar":
                checksum, size, table, ranges = _tar_entry(fs, path, where, local)
                samples = len(table)
                shard_schema = {f: "binary" for f in table.fields} if samples else None
                sidecar = table.encode()
                target.write_bytes(sidecar_path(name), sidecar)
                extra[OFFSETS_KEY] = offsets_entry(sidecar_path(name), sidecar)
            else:
                checksum, size, samples, groups, shard_schema, ranges = _parquet_entry(fs, path, where, local)
                extra["row_groups"] = groups
            target.write_bytes(ranges_path(name), ranges)
            extra[RANGES_KEY] = ranges_entry(ranges_path(name), ranges)
            if shard_schema is not None:
                if schema is None:
                    schema, schema_from = shard_schema, name
                else:
                    check_schema(
                        shard_schema, schema,
                        where=f"shards {schema_from!r} and {name!r} have different schemas",
                    )
            shards.append(ShardInfo(name, fmt, samples, size, checksum, extra))
        if schema is None:
            raise SchemaError(f"{url}: every shard is empty; no schema to index")
        index = Index(schema=schema, shards=tuple(shards))
        write_index(target, index, shard_table)
    return index
