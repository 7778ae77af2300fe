"""Whole-cache maintenance: make the ledger agree with the files, report usage, prune, verify.

All of it is safe while training processes use the cache: it takes the same kernel-held locks
as readers and downloaders (see `store.py`), skips pinned shards and downloads in progress, and
never removes a file a process is reading.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from shardloader.cache.layout import COMPANION_SUFFIXES, parse_cache_name, temp_owner
from shardloader.cache.ledger import Entry, Ledger
from shardloader.cache.locks import close_fd, held_elsewhere, open_fd
from shardloader.cache.store import ShardCache, hash_file, remove_temps


def reconcile(cache: ShardCache, ledger: Ledger) -> None:
    """Make `ledger` agree with the files of `cache`: add shards it lacks (a process killed
    between rename and bookkeeping), drop entries whose file is gone, remove companion files
    whose shard is gone, and remove temp files whose downloader is dead. Runs once per process,
    when the cache opens its ledger."""
    layout = cache.layout
    with cache.bookkeeping():
        present: dict[str, os.stat_result] = {}
        for name, path in layout.data_files():
            with contextlib.suppress(FileNotFoundError):
                present[name] = os.stat(path)
        known = ledger.entries()
        for name in known:
            if name not in present:
                ledger.forget(name)
        added = 0
        for name, st in present.items():
            if name not in known:
                size = st.st_size
                for suffix in COMPANION_SUFFIXES:
                    with contextlib.suppress(FileNotFoundError):
                        size += os.stat(layout.path_of(name) + suffix).st_size
                ledger.commit(name, Entry(size, st.st_mtime))
                added += size
        if added:
            ledger.note_usage(sum(e.bytes for e in ledger.entries().values()))
        for name, path in layout.companion_files():
            if not os.path.exists(layout.path_of(name)) and not held_elsewhere(layout.lock_of(name)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    for entry in os.listdir(layout.tmp_dir):
        name = temp_owner(entry)
        if name is None:
            continue
        try:
            fd = open_fd(layout.lock_of(name), os.O_RDWR | os.O_CREAT)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            remove_temps(layout, name)
        except BlockingIOError:
            pass  # being downloaded right now
        finally:
            close_fd(fd)


def usage(cache: ShardCache) -> dict[str, int]:
    """Bytes and files on disk now: committed shards (with companions) and temp files."""
    layout = cache.layout
    data = files = 0
    for _, path in layout.data_files():
        with contextlib.suppress(FileNotFoundError):
            data += os.stat(path).st_size
            files += 1
        for suffix in COMPANION_SUFFIXES:
            with contextlib.suppress(FileNotFoundError):
                data += os.stat(path + suffix).st_size
    tmp = 0
    for entry in os.listdir(layout.tmp_dir):
        with contextlib.suppress(FileNotFoundError):
            tmp += os.stat(os.path.join(layout.tmp_dir, entry)).st_size
    return {"data_bytes": data, "files": files, "tmp_bytes": tmp, "limit": cache.limit}


def prune(cache: ShardCache, target: int) -> dict[str, int]:
    """Evict least recently used unpinned shards until at most `target` bytes remain.

    Returns counts: evicted, bytes_freed, remaining (pinned shards and downloads in flight
    stay, so `remaining` may be above `target`)."""
    ledger = cache.ledger
    before = dict(cache.counters)
    remaining = None
    with cache.bookkeeping():
        if target < cache.limit:
            shortage = cache.make_room("", cache.limit - max(0, target))
            remaining = shortage.total if shortage is not None else None
    if remaining is None:
        remaining = sum(e.bytes for e in ledger.entries().values())
    return {
        "evicted": int(cache.counters["evictions"] - before["evictions"]),
        "bytes_freed": int(cache.counters["bytes_evicted"] - before["bytes_evicted"]),
        "remaining": int(remaining),
    }


def verify_all(cache: ShardCache, *, remove: bool = False) -> Iterator[tuple[str, str, str]]:
    """Re-hash every cached file: yields (path, status, detail), status 'ok' or 'corrupt'.

    With `remove`, a corrupt file is deleted (under its download lock) so the next reader
    fetches it again.
    """
    cache.ledger  # noqa: B018 - reconcile first
    for name, path in cache.layout.data_files():
        checksum, _ = parse_cache_name(name)  # type: ignore[misc]
        try:
            fd = open_fd(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            actual = hash_file(fd, checksum)
            st = os.fstat(fd)
        finally:
            close_fd(fd)
        if actual == checksum:
            yield path, "ok", ""
            continue
        detail = f"hashes to {actual}, its name says {checksum}"
        if remove:
            cache.discard(name, (st.st_ino, st.st_dev))
            detail += " (removed)"
        yield path, "corrupt", detail
