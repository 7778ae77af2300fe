"""Reading a dataset's `index.json` from its root (a local path or any fsspec URL).

Parsing a large index allocates far more than the index keeps: the parsed JSON (a dict, a few
strings and ints per shard: about 1.3 KB per shard) is dropped once the columns are built (about
70 bytes per shard, see `shardloader.format.index`), but the C allocator keeps the freed heap
mapped, so the process's RSS would stay at its peak. After an index of `_TRIM_BYTES` or more,
the heap's free pages are handed back to the kernel (glibc's `malloc_trim`; elsewhere nothing
happens). Measured after `Index.loads` of 10^4 shards: RSS +11.6 MB, +1.7 MB after the trim
(the columns hold 0.7 MB); `benchmarks/scale.py`, 10^6 shards: `Dataset()` grows the process
by 82 bytes per shard (1,446 before the columns and the trim).
"""

from __future__ import annotations

import os
from typing import Any

from shardloader.errors import DatasetIndexError
from shardloader.format.index import INDEX_NAME, Index
from shardloader.io.paths import is_local, join_url, strip_file_scheme
from shardloader.io.retry import RetryPolicy
from shardloader.runtime.heap import trim_heap

#: Index files from this size on (about 4,000 shards) are followed by a heap trim: below it
#: there is little to give back. A trim costs about a millisecond (0.6 ms after 10^4 shards).
_TRIM_BYTES = 1 << 20


def load_index(url: str, storage_options: dict[str, Any] | None = None, *,
               retry: RetryPolicy | None = None) -> Index:
    """Read and validate `index.json` at dataset root `url` (local path or fsspec URL); a remote
    one (and its shard table) with `retry`'s backoff on transient errors (default: RetryPolicy())."""
    index_url = join_url(url, INDEX_NAME)
    try:
        if is_local(url):  # plain open: a local dataset loads no fsspec (~1 MB per process)
            with open(strip_file_scheme(index_url), "rb") as f:
                text = f.read()
        else:  # remote: transient errors are retried with backoff, like shard downloads
            from shardloader.io.transfer import read_bytes

            text = read_bytes(index_url, storage_options, policy=retry)
    except (FileNotFoundError, NotADirectoryError):
        from shardloader.format.roots import missing_index_message  # names what was passed

        raise DatasetIndexError(missing_index_message(url, index_url)) from None
    size = len(text)
    try:
        if b'"shard_table"' in text:  # the table form (see shardloader.format.index_table)
            return _load_table_form(url, index_url, text, storage_options, retry)
        return Index.loads(text, source=index_url)
    finally:
        del text
        if size >= _TRIM_BYTES:
            trim_heap()


def _load_table_form(url: str, index_url: str, text: bytes,
                     storage_options: dict[str, Any] | None, retry: RetryPolicy | None) -> Index:
    """An index whose shards are in a table file beside it: the file is mapped (local; forked
    workers share its pages) or read through the same helper as `index.json` (remote)."""
    from shardloader.format.index_table import TABLE_KEY, read_table, table_entry
    from shardloader.io.jsondata import parse_json

    data = parse_json(text, what=index_url, error=DatasetIndexError)
    if not isinstance(data, dict) or TABLE_KEY not in data or "shards" in data:
        return Index.from_json(data, source=index_url)
    entry = table_entry(data[TABLE_KEY], source=index_url)
    table_url = join_url(url, entry["path"])
    try:
        if is_local(url):
            import mmap

            with open(strip_file_scheme(table_url), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                table: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        else:
            from shardloader.io.transfer import read_bytes

            table = read_bytes(table_url, storage_options, policy=retry)
    except (FileNotFoundError, NotADirectoryError):
        raise DatasetIndexError(f"{table_url}: the shard table that {index_url} names is missing") from None
    columns = read_table(table, entry, source=table_url)
    if len(table) >= _TRIM_BYTES:  # the checks' temporaries (a few arrays per shard) go back
        trim_heap()
    return Index.from_json(data, source=index_url, shard_columns=columns)
