"""Whole-cache maintenance (the `shardloader cache` commands): report usage, prune, verify.

All of it is safe while training processes use the cache: it takes the same kernel-held locks
as readers and downloaders (see `store.py` and `room.py`), skips pinned shards and downloads in
progress, and never removes a file a process is reading. Making the ledger agree with the files
is `reconcile.py`, which the store runs when it opens its ledger.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from shardloader.cache.layout import COMPANION_SUFFIXES, is_sidecar, parse_cache_name
from shardloader.cache.locks import close_fd, open_fd
from shardloader.cache.room import make_room
from shardloader.cache.shard_files import hash_file
from shardloader.cache.store import ShardCache


def usage(cache: ShardCache) -> dict[str, int]:
    """Bytes and files on disk now: committed entries (`data_bytes`: shards with their
    companions, and range sidecars), of which `files` shards and `sidecars` range sidecars of
    `sidecar_bytes`, and temp files."""
    layout = cache.layout
    data = files = sidecars = sidecar_bytes = 0
    for name, path in layout.data_files():
        with contextlib.suppress(FileNotFoundError):
            size = os.stat(path).st_size
            data += size
            if is_sidecar(name):
                sidecars += 1
                sidecar_bytes += size
                continue
            files += 1
        for suffix in COMPANION_SUFFIXES:
            with contextlib.suppress(FileNotFoundError):
                data += os.stat(path + suffix).st_size
    tmp = 0
    for entry in os.listdir(layout.tmp_dir):
        with contextlib.suppress(FileNotFoundError):
            tmp += os.stat(os.path.join(layout.tmp_dir, entry)).st_size
    return {"data_bytes": data, "files": files, "sidecars": sidecars, "sidecar_bytes": sidecar_bytes,
            "tmp_bytes": tmp, "limit": cache.limit}


def prune(cache: ShardCache, target: int) -> dict[str, int]:
    """Evict least recently used unpinned entries (shards, range sidecars) until at most
    `target` bytes remain.

    Returns counts: evicted (entries), evicted_sidecars (of those), bytes_freed, remaining
    (pinned shards and downloads in flight stay, so `remaining` may be above `target`)."""
    ledger = cache.ledger
    before = dict(cache.counters)
    sidecars_before = {name for name in ledger.entries() if is_sidecar(name)}
    remaining = None
    with cache.bookkeeping():
        if target < cache.limit:
            shortage = make_room(cache, "", cache.limit - max(0, target), disk=False)
            remaining = shortage.total if shortage is not None else None
    if remaining is None:
        remaining = sum(e.bytes for e in ledger.entries().values())
    return {
        "evicted": int(cache.counters["evictions"] - before["evictions"]),
        "evicted_sidecars": len(sidecars_before - set(ledger.entries())),
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
