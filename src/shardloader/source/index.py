"""Reading a dataset's `index.json` from its root (a local path or any fsspec URL)."""

from __future__ import annotations

from typing import Any

from shardloader.errors import DatasetIndexError
from shardloader.format.index import INDEX_NAME, Index
from shardloader.io.paths import is_local, join_url, strip_file_scheme


def load_index(url: str, storage_options: dict[str, Any] | None = None) -> Index:
    """Read and validate `index.json` at dataset root `url` (local path or fsspec URL)."""
    index_url = join_url(url, INDEX_NAME)
    try:
        if is_local(url):  # plain open: a local dataset loads no fsspec (~1 MB per process)
            with open(strip_file_scheme(index_url), "rb") as f:
                text = f.read()
        else:  # remote: transient errors are retried with backoff, like shard downloads
            from shardloader.io.transfer import read_bytes

            text = read_bytes(index_url, storage_options)
    except (FileNotFoundError, NotADirectoryError):
        from shardloader.format.roots import missing_index_message  # names what was passed

        raise DatasetIndexError(missing_index_message(url, index_url)) from None
    return Index.loads(text, source=index_url)
