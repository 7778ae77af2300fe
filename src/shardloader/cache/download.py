"""Downloading a shard into temp files of the cache, and giving them their final names.

This is how a shard appears atomically (design invariant I6): its file and its companions are
written to new owner-only temp files under `tmp/` (never read by anyone), their sizes checked
and fsynced, and only then renamed into `data/`, the companions first: the shard's own name
is the commit. The caller holds the shard's download lock throughout (so it is the only writer
of that shard's temp files) and the bookkeeping lock around `install`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shardloader.cache.layout import COMPANION_SUFFIXES, CacheLayout
from shardloader.cache.locks import FILE_MODE
from shardloader.errors import ShardError, ShardloaderError
from shardloader.format.index import ShardInfo
from shardloader.io.transfer import FetchStats

log = logging.getLogger(__name__)

# Fetch callback: write the shard into an open, empty file descriptor; may raise FetchError or
# FetchCancelled; returns what it cost.
Fetch = Callable[[int, "threading.Event | None"], FetchStats]
# A downloaded companion file: (its temp file, its final path, its bytes).
KeptCompanion = tuple[str, str, int]


@dataclass(frozen=True)
class Companion:
    """A small file stored next to a cached shard as `<shard path><suffix>` (e.g. a tar's
    offsets sidecar). It is fetched with the shard, counted in its size and evicted with it;
    its reader verifies it (a companion that cannot be fetched is skipped, not fatal)."""

    suffix: str
    bytes: int
    fetch: Fetch

    def __post_init__(self) -> None:
        if self.suffix not in COMPANION_SUFFIXES:
            raise ValueError(f"companion suffix {self.suffix!r} is not one of {COMPANION_SUFFIXES}")


@contextlib.contextmanager
def temp_files(layout: CacheLayout, name: str) -> Iterator[Callable[[], str]]:
    """A maker of new temp paths for shard `name`; whatever of them is still there (not
    renamed into place) when the block ends is removed."""
    temps: list[str] = []

    def new_temp() -> str:
        temps.append(layout.new_temp(name))
        return temps[-1]

    try:
        yield new_temp
    finally:
        for temp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)


def download_shard(
    new_temp: Callable[[], str], info: ShardInfo, path: str, fetch: Fetch,
    companions: tuple[Companion, ...], cancel: threading.Event | None,
) -> tuple[str, FetchStats, os.stat_result, list[KeptCompanion]]:
    """Download shard `info` and its companions into new temp files.

    Returns the shard's temp file, what the downloads cost together, the shard file's stat and
    the companions that were fetched (one that cannot be is skipped with a warning)."""
    tmp = new_temp()
    stats, st = _download_into(tmp, fetch, cancel, info.bytes, info.path)
    kept: list[KeptCompanion] = []
    for companion in companions:
        ctmp = new_temp()
        try:
            cstats, _ = _download_into(ctmp, companion.fetch, cancel, companion.bytes, info.path + companion.suffix)
        except ShardloaderError as e:  # optional: its reader can do without it
            log.warning("%s: companion %s not cached: %s", info.path, companion.suffix, e)
            continue
        stats.bytes_received += cstats.bytes_received
        stats.seconds += cstats.seconds
        kept.append((ctmp, path + companion.suffix, companion.bytes))
    return tmp, stats, st, kept


def install(tmp: str, path: str, kept: list[KeptCompanion]) -> None:
    """Rename the downloaded files to their final names (caller holds the bookkeeping lock)."""
    for ctmp, final, _ in kept:  # companions first: the shard's name is the commit
        os.rename(ctmp, final)
    os.rename(tmp, path)


def _download_into(
    tmp: str, fetch: Fetch, cancel: threading.Event | None, size: int, what: str
) -> tuple[FetchStats, os.stat_result]:
    """Fetch into a new owner-only temp file, check its size, fsync it."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        stats = fetch(fd, cancel)
        os.fsync(fd)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_size != size:
        raise ShardError(f"{what}: download wrote {st.st_size} bytes, expected {size}")
    return stats, st
