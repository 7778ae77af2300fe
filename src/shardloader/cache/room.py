"""Room in the node cache: reserving space for a download within the hard limit, evicting.

Committed shards plus reservations of downloads in flight never exceed the cache's `limit`
(design invariant I6). Reservations are valid only while their shard's download lock is held,
so a dead downloader's reservation is dropped by the next eviction pass. Eviction removes the
least recently used unpinned shards: it takes a non-blocking exclusive `flock` on the file, skips
files it cannot lock (a reader pins them), and unlinks under that lock. When pinned shards leave
no room, idle readers give up their pins: this process's at once (the releasers its reader pool
registered), other processes' through the pressure signal, while the reader waits a bounded time
(`full_timeout`). Prefetch never takes room a waiting reader needs: it backs off while a reader
waits, and its reservations stay below `limit - reader_reserve`. Only when pins that nobody can
give up leave no room does `CacheFullError` say so, never a hang. Room is also bounded by the
cache's filesystem, whatever the limit: a download is planned only when it fits in the free
space (after evictions) less the downloads in flight and `space.DISK_MARGIN`.

The cache these functions work for is given as a `RoomKeeper` (the store's `ShardCache`), so
that this module does not import the store.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Protocol

from shardloader.cache.layout import CacheLayout
from shardloader.cache.ledger import Ledger, Reservation
from shardloader.cache.locks import close_fd, held_elsewhere, try_exclusive
from shardloader.cache.pressure import POLL_SECONDS, PressureSignal
from shardloader.cache.shard_files import unlink_companions
from shardloader.cache.space import DISK_MARGIN, free_space, pending_writes
from shardloader.errors import CacheFullError
from shardloader.format.index import ShardInfo
from shardloader.units import format_size


class RoomKeeper(Protocol):
    """What making room needs from the cache it makes room in."""

    root: str
    layout: CacheLayout
    limit: int
    reader_reserve: int  # bytes prefetch downloads must leave free for readers
    full_timeout: float
    pressure: PressureSignal

    @property
    def ledger(self) -> Ledger: ...

    def bookkeeping(self) -> contextlib.AbstractContextManager[None]: ...

    def pinned_here(self, name: str) -> bool:
        """True while this process pins shard `name`."""
        ...

    def has_releasers(self) -> bool:
        """True when reader pools of this process registered releasers of idle pins."""
        ...

    def release_idle(self) -> int:
        """Close this process's idle readers; how many pins they gave up."""
        ...

    def count(self, **amounts: float) -> None:
        """Add `amounts` to this process's counters."""
        ...


@dataclass(frozen=True)
class RoomShortage:
    """Why a reservation did not fit: bytes pinned by this process, by others, in flight, and
    (when the filesystem's free space, not the limit, was the bound) the bytes it had free."""

    needed: int
    total: int
    pinned_here: int
    pinned_elsewhere: int
    reserved: int
    disk_free: int | None = None


def reserve(cache: RoomKeeper, info: ShardInfo, name: str, size: int, *, prefetch: bool) -> None:
    """Reserve `size` bytes for a download, evicting LRU unpinned shards as needed.

    A reader that finds no room releases this process's idle pins, then raises the pressure
    signal and waits (bounded by `full_timeout`) while other processes release theirs and
    downloads in flight finish. A prefetch never waits: it raises CacheFullError at once."""
    if size > cache.limit:
        raise CacheFullError(
            f"cache {cache.root}: shard {info.path} ({format_size(size)}) is larger than "
            f"the whole cache limit ({format_size(cache.limit)}); raise cache_limit"
        )
    if prefetch and cache.pressure.recent():
        raise CacheFullError(f"cache {cache.root}: a reader is waiting for room; prefetch backs off")
    deadline = time.monotonic() + cache.full_timeout
    waited = False
    while True:
        with cache.bookkeeping():
            shortage = make_room(cache, name, size, prefetch=prefetch)
            if shortage is None:
                cache.ledger.reserve(name, Reservation(size, os.getpid(), prefetch))
                return
        if prefetch:
            raise CacheFullError(_full_message(cache, info, size, shortage))
        if shortage.pinned_here and cache.release_idle():
            continue  # this process's idle readers gave up their pins: try again at once
        transient_here = cache.has_releasers() and shortage.pinned_here > 0
        others = shortage.pinned_elsewhere + shortage.reserved
        if (others == 0 and not transient_here) or time.monotonic() >= deadline:
            raise CacheFullError(_full_message(cache, info, size, shortage))
        if not waited:
            waited = True
            cache.count(full_waits=1)
        cache.pressure.raise_()  # other processes: give up idle pins; prefetchers: back off
        time.sleep(POLL_SECONDS)


def _full_message(cache: RoomKeeper, info: ShardInfo, size: int, s: RoomShortage) -> str:
    if s.disk_free is not None:
        return (
            f"cache {cache.root}: no room for shard {info.path} ({format_size(size)}) on the "
            f"cache's filesystem: it has {format_size(s.disk_free)} free, less "
            f"{format_size(DISK_MARGIN)} the cache leaves for its ledger: "
            f"{format_size(max(0, s.disk_free - DISK_MARGIN))} for shards; shards being read pin "
            f"{format_size(s.pinned_here)} in this process and {format_size(s.pinned_elsewhere)} "
            f"in others, with {format_size(s.reserved)} of downloads in flight. Other files "
            f"take the space (the cache limit, {format_size(cache.limit)}, is not reached): "
            f"free space on that filesystem, lower num_workers or the ranks per node (each "
            f"reader holds one shard), or point cache_dir (or $SHARDLOADER_CACHE_DIR) at a "
            f"filesystem with room"
        )
    return (
        f"cache {cache.root}: no room for shard {info.path} ({format_size(size)}): the "
        f"limit is {format_size(cache.limit)} and shards being read pin "
        f"{format_size(s.pinned_here)} in this process and {format_size(s.pinned_elsewhere)} "
        f"in others, with {format_size(s.reserved)} of downloads in flight. The cache must "
        f"hold one shard per reading thread on the node plus the downloads in flight: raise "
        f"cache_limit, or lower num_workers or the ranks per node"
    )


def make_room(cache: RoomKeeper, name: str, size: int, *, prefetch: bool = False,
              disk: bool = True) -> RoomShortage | None:
    """Evict until `size` more bytes fit (caller holds the bookkeeping lock); None when
    they fit, else what stands in the way. Least recently used first, shards that no
    reader opened yet last. A prefetch evicts only shards that were read, and must leave
    `reader_reserve` bytes to readers beyond the reservations of other prefetches.

    With `disk` (all but `prune`), what fits is also bounded by the filesystem: the download
    and those in flight must fit in its free space (plus what evictions free) less
    `DISK_MARGIN`, whatever the limit says: see `disk_bound`."""
    ledger = cache.ledger
    committed = ledger.entries()
    entries = {n: e.bytes for n, e in committed.items()}
    reserved = prefetching = 0
    in_flight: dict[str, int] = {}
    for other, reservation in ledger.reservations().items():
        if other == name:
            continue
        if reservation is None or not held_elsewhere(cache.layout.lock_of(other)):
            ledger.release_reservation(other)  # its downloader died or finished uncleanly
            continue
        reserved += reservation.bytes
        prefetching += reservation.bytes if reservation.prefetch else 0
        in_flight[other] = reservation.bytes
    limit, disk_free = cache.limit, None
    if disk:
        bound = disk_bound(cache, sum(entries.values()), reserved, in_flight)
        if bound is not None and bound[0] < limit:
            limit, disk_free = bound
    if prefetch and prefetching + size > limit - cache.reader_reserve:
        return RoomShortage(size, sum(entries.values()) + reserved, 0, 0, reserved, disk_free)
    total = sum(entries.values()) + reserved
    if total + size > limit:
        pinned_here = pinned_elsewhere = 0
        # Shards no reader opened since they arrived (prefetched ahead) go last, and a
        # prefetch never evicts them: it would throw away what it fetched for the readers.
        unread = {n for n, e in committed.items() if ledger.opened_at(n) < e.created}
        for victim in sorted(entries, key=lambda n: (n in unread, ledger.atime(n), n)):
            if total + size <= limit:
                break
            if prefetch and victim in unread:
                break
            if _evict(cache, victim) is None:
                if cache.pinned_here(victim):
                    pinned_here += entries[victim]
                else:
                    pinned_elsewhere += entries[victim]
                continue
            total -= entries[victim]
        if total + size > limit:
            return RoomShortage(size, total, pinned_here, pinned_elsewhere, reserved, disk_free)
    ledger.note_usage(total + size)
    return None


def disk_bound(cache: RoomKeeper, committed: int, reserved: int,
               in_flight: dict[str, int]) -> tuple[int, int] | None:
    """(the most committed plus reserved bytes the filesystem allows now, its free bytes), or
    None when its free space is unknown. Evicting a shard frees its bytes on disk as well as
    in the limit, so the bound is the committed bytes plus the free space, less what downloads
    in flight (`in_flight`: name -> bytes reserved) have still to write and `DISK_MARGIN`,
    plus the reservations (already counted in the total it bounds)."""
    space = free_space(cache.root)
    if space is None:
        return None
    free = space[0]
    pending = pending_writes(cache.layout.tmp_dir, in_flight)
    return committed + reserved + free - pending - DISK_MARGIN, free


def _evict(cache: RoomKeeper, name: str) -> int | None:
    """Remove `name` unless a reader pins it; bytes freed (0 if it was already gone)."""
    path = cache.layout.path_of(name)
    if not os.path.exists(path):
        cache.ledger.forget(name)
        return 0
    fd = try_exclusive(path)
    if fd is None:
        if not os.path.exists(path):
            cache.ledger.forget(name)
            return 0
        return None
    try:
        size = os.fstat(fd).st_size
        os.unlink(path)
        size += unlink_companions(path)
        cache.ledger.forget(name)
        cache.ledger.note_evicted(name)
        cache.count(evictions=1, bytes_evicted=size)
        return size
    finally:
        close_fd(fd)
