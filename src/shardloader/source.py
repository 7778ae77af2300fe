"""Where shard files come from: the local dataset directory, or a remote URL through the cache.

A source turns a shard's index entry into a local file path that is whole and verified. The
local source reads in place (never copies, never deletes); the remote source (see
`shardloader.cache`) downloads into the node's shard cache. Each process verifies a shard's
checksum the first time it opens it (invariant I6), so a file damaged after an earlier
verification is caught.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any, Protocol

import fsspec

from shardloader.errors import ChecksumMismatch, DatasetIndexError, ShardError
from shardloader.format.checksum import checksum_file, parse_checksum
from shardloader.format.index import INDEX_NAME, Index, ShardInfo
from shardloader.format.paths import join_url


class ShardSource(Protocol):
    """Gives local, verified paths for a dataset's shards."""

    root: str

    def local_path(self, info: ShardInfo) -> str:
        """A local path to the whole, verified file of shard `info` (fetching it if needed)."""
        ...

    def release(self, info: ShardInfo) -> None:
        """The caller no longer reads shard `info` (a cached shard may be evicted again)."""
        ...

    def start_prefetch(self, shard_infos: Iterable[ShardInfo]) -> Any:
        """Start fetching `shard_infos` (in order of first need) in the background; returns a
        handle with `stop()`. Never blocks the caller."""
        ...

    def counters(self) -> dict[str, float]:
        """This process's counters: cache_hits, cache_misses, bytes_downloaded,
        download_seconds, wait_seconds (zeros for a local source)."""
        ...


def is_local(url: str) -> bool:
    """True for plain paths and file:// URLs."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return protocol in ("file", "local")


def strip_file_scheme(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def load_index(url: str, storage_options: dict[str, Any] | None = None) -> Index:
    """Read and validate `index.json` at dataset root `url` (local path or fsspec URL)."""
    index_url = join_url(url, INDEX_NAME)
    try:
        if is_local(url):
            with fsspec.open(index_url, "rb", **(storage_options or {})) as f:
                text = f.read()
        else:  # remote: transient errors are retried with backoff, like shard downloads
            from shardloader.cache.fetch import read_bytes

            text = read_bytes(index_url, storage_options)
    except (FileNotFoundError, NotADirectoryError):
        from shardloader.format.roots import missing_index_message  # names what was passed

        raise DatasetIndexError(missing_index_message(url, index_url)) from None
    return Index.loads(text, source=index_url)


def verify_local_file(path: str, info: ShardInfo) -> None:
    """Raise a ShardError naming `path` unless it has the size and checksum of `info`."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise ShardError(f"{path}: shard file is missing (listed in the index as {info.path!r})") from None
    if size != info.bytes:
        raise ShardError(
            f"{path}: shard is {size} bytes but the index records {info.bytes} "
            f"({'truncated' if size < info.bytes else 'larger than expected'})"
        )
    algorithm, _ = parse_checksum(info.checksum)
    actual, _ = checksum_file(path, algorithm)
    if actual != info.checksum:
        raise ChecksumMismatch(f"{path}: checksum {actual} does not match the index ({info.checksum})")


class LocalSource:
    """Shards read in place from a local directory. Verified once per process, never copied."""

    def __init__(self, root: str, *, verify: bool = True) -> None:
        self.root = os.path.abspath(strip_file_scheme(root))
        self.verify = verify
        self._verified: set[str] = set()
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def local_path(self, info: ShardInfo) -> str:
        path = os.path.join(self.root, info.path)
        if os.getpid() != self._pid:  # a forked worker verifies for itself
            self._verified = set()
            self._pid = os.getpid()
        if info.path in self._verified:
            return path
        if self.verify:
            verify_local_file(path, info)
        elif not os.path.exists(path):
            raise ShardError(f"{path}: shard file is missing (listed in the index as {info.path!r})")
        with self._lock:
            self._verified.add(info.path)
        return path

    def release(self, info: ShardInfo) -> None:
        return None

    def start_prefetch(self, shard_infos: Iterable[ShardInfo]) -> Any:
        """Nothing to prefetch: local shards are read in place."""
        from shardloader.cache.prefetch import NoPrefetch

        return NoPrefetch()

    def counters(self) -> dict[str, float]:
        return dict.fromkeys(
            ("cache_hits", "cache_misses", "bytes_downloaded", "download_seconds", "wait_seconds"), 0
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "verify": self.verify}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], verify=state["verify"])
