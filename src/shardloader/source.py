"""Where shard files come from: the local dataset directory, or a remote URL through the cache.

A source turns a shard's index entry into a local file path that is whole and verified. The
local source reads in place (never copies, never deletes); the remote source (see
`shardloader.cache`) downloads into the node's shard cache. Each process verifies a shard's
checksum the first time it opens it (invariant I6), so a file damaged after an earlier
verification is caught. The local source remembers the identity (inode, size, mtime) of each
file it verified and verifies again whenever the file at the path has another identity (I12): a
shard rewritten during a run is checked against the index before its reader is reopened.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any, Protocol

from shardloader.errors import ChecksumMismatch, DatasetIndexError, ShardChangedError, ShardError
from shardloader.format.checksum import checksum_stream, parse_checksum
from shardloader.format.identity import FileIdentity, path_identity
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

    # Optional: `verified_identity(info) -> FileIdentity | None`, the identity of the file
    # `local_path` last verified for `info`. A reader opened on any other file is reopened
    # (see `Dataset`); sources without it are trusted to keep their files unchanged.


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
        if is_local(url):  # plain open: a local dataset loads no fsspec (~1 MB per process)
            with open(strip_file_scheme(index_url), "rb") as f:
                text = f.read()
        else:  # remote: transient errors are retried with backoff, like shard downloads
            from shardloader.cache.fetch import read_bytes

            text = read_bytes(index_url, storage_options)
    except (FileNotFoundError, NotADirectoryError):
        from shardloader.format.roots import missing_index_message  # names what was passed

        raise DatasetIndexError(missing_index_message(url, index_url)) from None
    return Index.loads(text, source=index_url)


def _missing(path: str, info: ShardInfo) -> ShardError:
    return ShardError(f"{path}: shard file is missing (listed in the index as {info.path!r})")


def _check_size(path: str, size: int, info: ShardInfo) -> None:
    if size != info.bytes:
        raise ShardError(
            f"{path}: shard is {size} bytes but the index records {info.bytes} "
            f"({'truncated' if size < info.bytes else 'larger than expected'})"
        )


def verify_local_file(path: str, info: ShardInfo) -> FileIdentity:
    """The identity of the file at `path`, after checking that it has the size and checksum of
    `info`; otherwise a ShardError naming `path` (ShardChangedError if it changed meanwhile)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise _missing(path, info) from None
    with f:
        identity = FileIdentity.of(os.fstat(f.fileno()))
        _check_size(path, identity.size, info)
        algorithm, _ = parse_checksum(info.checksum)
        actual, _ = checksum_stream(f, algorithm)
        after = FileIdentity.of(os.fstat(f.fileno()))
    if after != identity:
        raise ShardChangedError(f"{path}: shard changed while being verified ({identity.change_to(after)})")
    if actual != info.checksum:
        raise ChecksumMismatch(f"{path}: checksum {actual} does not match the index ({info.checksum})")
    return identity


class LocalSource:
    """Shards read in place from a local directory, never copied.

    Each process verifies a file when it first opens it and again whenever the file at its
    path has another identity (inode, size, mtime) than the one it verified: a file replaced by
    rename or rewritten in place during a run is checked against the index before it is read.
    With `verify=False` only the size is checked against the index.
    """

    def __init__(self, root: str, *, verify: bool = True) -> None:
        self.root = os.path.abspath(strip_file_scheme(root))
        self.verify = verify
        self._verified: dict[str, FileIdentity] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def local_path(self, info: ShardInfo) -> str:
        path = os.path.join(self.root, info.path)
        if os.getpid() != self._pid:  # a forked worker verifies for itself
            self._verified = {}
            self._pid = os.getpid()
        try:
            now = path_identity(path)
        except FileNotFoundError:
            raise _missing(path, info) from None
        before = self._verified.get(info.path)
        if before == now:
            return path
        try:
            if self.verify:
                now = verify_local_file(path, info)
            else:
                _check_size(path, now.size, info)
        except ShardError as e:
            if before is None or isinstance(e, ShardChangedError):
                raise
            raise type(e)(f"{e}; the file changed during the run ({before.change_to(now)} "
                          "since this process verified it)") from None
        with self._lock:
            self._verified[info.path] = now
        return path

    def verified_identity(self, info: ShardInfo) -> FileIdentity | None:
        """The identity of the file `local_path` last verified for `info` in this process."""
        if os.getpid() != self._pid:
            return None
        return self._verified.get(info.path)

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
