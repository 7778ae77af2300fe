"""The node's shard cache: one directory on local disk shared by every process on the node.

This module is the reader side: pins, verification, downloads and room. The directory layout
is in `layout.py`, the locks in `locks.py`, the bookkeeping in `ledger.py`, and whole-cache
maintenance (`usage`, `prune`, `verify_all`, `reconcile`) in `maintenance.py`.

Rules that make the cache trustworthy (design invariant I6):

* A shard reaches its final name only by `rename` of a temp file that was downloaded, hashed to
  the index checksum and fsynced, so a name in `data/` always holds a whole file.
* Only the holder of a shard's download lock writes temp files of that shard, so exactly one
  process downloads a shard at a time; the others block on the lock and then find the file. The
  kernel drops the lock when its holder dies, so a killed process leaves nothing to clean up
  (its temp files are removed by the next lock holder).
* A reader pins a shard by holding a shared `flock` on the cached file while it reads it.
  Eviction takes a non-blocking exclusive `flock`, skips files it cannot lock, and unlinks under
  that lock; a reader that raced with an eviction notices that its descriptor no longer matches
  the name and fetches again.
* Each process hashes a cached file the first time it opens it (and again when the file's
  inode, size or mtime changed), so a file damaged since an earlier check is caught, removed and
  fetched again.
* Space: committed shards plus reservations of downloads in flight never exceed `limit`.
  Reservations are valid only while their shard's download lock is held, so a dead
  downloader's reservation is dropped by the next eviction pass. Eviction removes the least
  recently used unpinned shards. When pinned shards leave no room, idle readers give up their
  pins: this process's at once (the releasers its reader pool registered), other processes'
  through the pressure signal, while the reader waits a bounded time (`full_timeout`). Prefetch
  never takes room a waiting reader needs: it backs off while a reader waits, and its
  reservations stay below `limit - reader_reserve`. Only when pins that nobody can give up
  leave no room does `CacheFullError` say so, never a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from shardloader.cache.fetch import FetchStats
from shardloader.cache.layout import COMPANION_SUFFIXES, Layout, cache_name, parse_cache_name
from shardloader.cache.ledger import Entry, Ledger, Reservation
from shardloader.cache.locks import (
    FILE_MODE,
    after_fork_in_child,
    close_fd,
    exclusive,
    held_elsewhere,
    pin,
    try_exclusive,
)
from shardloader.cache.pressure import POLL_SECONDS, PressureSignal, PressureWatcher
from shardloader.errors import CacheFullError, ShardError, ShardloaderError
from shardloader.fileio import fsync_dir
from shardloader.format.checksum import checksum_fd, parse_checksum
from shardloader.format.index import ShardInfo
from shardloader.units import format_size

log = logging.getLogger(__name__)

# Fetch callback: write the shard into an open, empty file descriptor; may raise FetchError or
# FetchCancelled; returns what it cost.
Fetch = Callable[[int, "threading.Event | None"], FetchStats]
# Releaser: closes this process's idle shard readers (unpinning them); returns how many.
Releaser = Callable[[], int]

COUNTER_NAMES = (
    "cache_hits", "cache_misses", "bytes_downloaded", "download_seconds", "wait_seconds",
    "verify_seconds", "downloads", "prefetched", "retries", "evictions", "bytes_evicted",
    "corrupt_refetched", "redownloads", "idle_released", "full_waits",
)


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


@dataclass(frozen=True)
class RoomShortage:
    """Why a reservation did not fit: bytes pinned by this process, by others, in flight."""

    needed: int
    total: int
    pinned_here: int
    pinned_elsewhere: int
    reserved: int


_LIVE_CACHES: weakref.WeakSet[ShardCache] = weakref.WeakSet()


def _forget_caches_after_fork() -> None:
    for cache in list(_LIVE_CACHES):
        cache._forget_after_fork()


after_fork_in_child(_forget_caches_after_fork)


class ShardCache:
    """A node-level, size-limited, content-addressed cache of verified shard files.

    `reader_reserve` is the room (bytes) prefetch downloads must leave free for readers; the
    capacity check sets it from the configuration (see `capacity.py`)."""

    def __init__(self, root: str | os.PathLike[str], limit: int, *, full_timeout: float = 30.0):
        if limit <= 0:
            raise ValueError(f"cache limit must be positive, got {limit}")
        self.layout = Layout.create(root)
        self.root = self.layout.root
        self.limit = int(limit)
        self.full_timeout = float(full_timeout)
        self.reader_reserve = 0
        self.pressure = PressureSignal(self.layout.pressure_file)
        self._mutex = threading.RLock()
        self._reset_process_state()
        _LIVE_CACHES.add(self)

    # -- per-process state ---------------------------------------------------------------------
    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._ledger: Ledger | None = None
        self._pins: dict[str, list[int]] = {}  # name -> [fd, count]
        self._verified: set[tuple[str, int, int, int]] = set()  # (name, ino, size, mtime_ns)
        self._releasers: list[weakref.WeakMethod | Callable[[], Releaser | None]] = []
        self._watcher: PressureWatcher | None = None
        self.counters: dict[str, float] = dict.fromkeys(COUNTER_NAMES, 0)

    def _forget_after_fork(self) -> None:
        """In a forked child: forget inherited pins (their descriptors were closed by the fork
        hook; the parent keeps its own pins), releasers and the per-process state."""
        self._mutex = threading.RLock()
        self._reset_process_state()

    @property
    def ledger(self) -> Ledger:
        """This process's ledger, opened (and the cache reconciled) on first use.

        Public methods use it before taking any lock: reconciling takes the bookkeeping lock,
        which is not re-entrant across descriptors."""
        if self._pid != os.getpid():
            self._forget_after_fork()
        if self._ledger is None:
            from shardloader.cache.maintenance import reconcile

            ledger = Ledger(self.layout.index_dir)
            reconcile(self, ledger)
            self._ledger = ledger
        return self._ledger

    def path_of(self, name: str) -> str:
        return self.layout.path_of(name)

    def path_for(self, info: ShardInfo) -> str:
        return self.layout.path_of(cache_name(info))

    # -- idle pins: giving them up under pressure ----------------------------------------------
    def add_releaser(self, releaser: Releaser) -> None:
        """Register a callable that closes this process's idle readers (a bound method is held
        weakly). It is called when a reader of this process needs room, and from a watcher
        thread when a reader of another process does."""
        self.ledger  # noqa: B018 - per-process state first (a fork resets it)
        ref: weakref.WeakMethod | Callable[[], Releaser | None]
        try:
            ref = weakref.WeakMethod(releaser)  # type: ignore[arg-type]
        except TypeError:
            ref = lambda: releaser  # noqa: E731 - a plain function: hold it
        with self._mutex:
            self._releasers.append(ref)
            if self._watcher is None:
                self._watcher = PressureWatcher(self.pressure, self, ShardCache.release_idle)

    def release_idle(self) -> int:
        """Ask this process's reader pools to close idle readers; how many pins they gave up."""
        with self._mutex:
            refs = list(self._releasers)
        released = 0
        for ref in refs:
            releaser = ref()
            if releaser is not None:
                released += int(releaser() or 0)
        if released:
            with self._mutex:
                self.counters["idle_released"] += released
        return released

    # -- reading: open (pin) and release -------------------------------------------------------
    def open(self, info: ShardInfo, fetch: Fetch, companions: tuple[Companion, ...] = ()) -> str:
        """A pinned local path to the whole, verified file of `info`, fetching it if needed.

        The shard stays pinned (never evicted) until `release(info)` is called as many times
        as `open`.
        """
        self.ledger  # noqa: B018 - open (and reconcile) before any lock is taken
        name = cache_name(info)
        path = self.path_of(name)
        with self._mutex:
            held = self._pins.get(name)
            if held is not None:
                held[1] += 1
                self.counters["cache_hits"] += 1
                return path
        hit = True
        while True:
            fd = pin(path)
            if fd is None:
                hit = False
                self._fill(info, name, fetch, companions, prefetch=False, cancel=None)
                continue
            try:
                ok = self._check(info, name, fd)
            except BaseException:
                close_fd(fd)
                raise
            if not ok:
                close_fd(fd)
                with self._mutex:
                    self.counters["corrupt_refetched"] += 1
                hit = False
                continue
            with self._mutex:
                held = self._pins.get(name)
                if held is not None:  # another thread pinned it meanwhile: share its pin
                    close_fd(fd)
                    held[1] += 1
                else:
                    self._pins[name] = [fd, 1]
                self.counters["cache_hits" if hit else "cache_misses"] += 1
            self._touch(name, opened=True)
            return path

    def release(self, info: ShardInfo) -> None:
        """Undo one `open(info)`; the last release unpins the shard (it may be evicted)."""
        name = cache_name(info)
        with self._mutex:
            held = self._pins.get(name)
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del self._pins[name]
            close_fd(held[0])
        self._touch(name)

    def release_all(self) -> None:
        with self._mutex:
            pins, self._pins = self._pins, {}
        for fd, _ in pins.values():
            with contextlib.suppress(OSError):
                close_fd(fd)

    def _touch(self, name: str, *, opened: bool = False) -> None:
        """Record an access (LRU order) and, for a reader, the open (the prefetcher's signal).
        Advisory: a failure here must not lose a pin or fail a read."""
        try:
            self.ledger.touch(name, time.time(), opened=opened)
        except Exception:  # noqa: BLE001 - e.g. sqlite busy for longer than its timeout
            log.warning("cache %s: could not record an access to %s", self.root, name, exc_info=True)

    def _check(self, info: ShardInfo, name: str, fd: int) -> bool:
        """Verify the pinned file once per process; discard it and return False if it is bad."""
        st = os.fstat(fd)
        key = (name, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._mutex:
            if key in self._verified:
                return True
        start = time.monotonic()
        digest = hash_file(fd, info.checksum) if st.st_size == info.bytes else None
        ok = digest == info.checksum
        with self._mutex:
            self.counters["verify_seconds"] += time.monotonic() - start
            if ok:
                self._verified.add(key)
        if not ok:
            # Rare and worth knowing (a damaged disk, or something else writing into the cache),
            # and the one way a shard leaves the cache without counting as evicted.
            log.warning("%s: cached file %s (inode %d) failed verification: %d bytes, index says "
                        "%d%s; discarding it and fetching again", info.path, self.path_of(name),
                        st.st_ino, st.st_size, info.bytes,
                        "" if digest is None else f", checksum {digest} instead of {info.checksum}")
            self.discard(name, (st.st_ino, st.st_dev))
        return ok

    def discard(self, name: str, identity: tuple[int, int]) -> None:
        """Remove a damaged cached file, unless someone already replaced it."""
        path = self.path_of(name)
        with exclusive(self.layout.lock_of(name)), self.bookkeeping():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return
            if (st.st_ino, st.st_dev) == identity:
                os.unlink(path)
                unlink_companions(path)
                self.ledger.forget(name)

    # -- prefetch: make present without pinning -----------------------------------------------
    def ensure(
        self, info: ShardInfo, fetch: Fetch, companions: tuple[Companion, ...] = (),
        cancel: threading.Event | None = None,
    ) -> str:
        """Make `info` present in the cache (no pin, no verification by this process).

        Returns "hit" or "downloaded". Raises CacheFullError at once when there is no room now
        or a reader waits for room (a prefetcher waits and tries again later), FetchError,
        FetchCancelled.
        """
        self.ledger  # noqa: B018
        name = cache_name(info)
        if os.path.exists(self.path_of(name)):
            self._touch(name)
            return "hit"
        return self._fill(info, name, fetch, companions, prefetch=True, cancel=cancel)

    def opened_at(self, info: ShardInfo) -> float:
        """Wall-clock time of the latest reader open of `info` on this node (0 if never)."""
        return self.ledger.opened_at(cache_name(info))

    # -- filling: one downloader per shard -----------------------------------------------------
    def _fill(
        self, info: ShardInfo, name: str, fetch: Fetch, companions: tuple[Companion, ...], *,
        prefetch: bool, cancel: threading.Event | None,
    ) -> str:
        path = self.path_of(name)
        with exclusive(self.layout.lock_of(name), on_wait=None if prefetch else self._count_wait):
            if os.path.exists(path):
                return "hit"
            remove_temps(self.layout, name)
            self._reserve(info, name, info.bytes + sum(c.bytes for c in companions), prefetch=prefetch)
            temps: list[str] = []
            committed = False
            try:
                tmp = self.layout.new_temp(name)
                temps.append(tmp)
                stats, st = _download_into(tmp, fetch, cancel, info.bytes, info.path)
                kept: list[tuple[str, str, int]] = []  # (temp, final path, bytes)
                for companion in companions:
                    ctmp = self.layout.new_temp(name)
                    temps.append(ctmp)
                    try:
                        cstats, _ = _download_into(
                            ctmp, companion.fetch, cancel, companion.bytes, info.path + companion.suffix
                        )
                    except ShardloaderError as e:  # optional: its reader can do without it
                        log.warning("%s: companion %s not cached: %s", info.path, companion.suffix, e)
                        continue
                    stats.bytes_received += cstats.bytes_received
                    stats.seconds += cstats.seconds
                    kept.append((ctmp, path + companion.suffix, companion.bytes))
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                with self.bookkeeping():
                    for ctmp, final, _ in kept:  # companions first: the shard's name is the commit
                        os.rename(ctmp, final)
                    os.rename(tmp, path)
                    committed = True
                    size = info.bytes + sum(n for _, _, n in kept)
                    self.ledger.commit(name, Entry(size, time.time()))
                    again = self.ledger.note_download(name, stats.bytes_received)
                fsync_dir(os.path.dirname(path))
                with self._mutex:
                    self._verified.add((name, st.st_ino, st.st_size, st.st_mtime_ns))
                    self.counters["bytes_downloaded"] += stats.bytes_received
                    self.counters["download_seconds"] += stats.seconds
                    self.counters["retries"] += stats.retries
                    self.counters["downloads"] += 1
                    self.counters["redownloads"] += int(again)
                    if prefetch:
                        self.counters["prefetched"] += 1
                return "downloaded"
            finally:
                for temp in temps:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temp)
                if not committed:
                    with self.bookkeeping():
                        self.ledger.release_reservation(name)

    def _count_wait(self, seconds: float) -> None:
        with self._mutex:
            self.counters["wait_seconds"] += seconds

    def bookkeeping(self) -> contextlib.AbstractContextManager[None]:
        """The node-wide lock over sizes, reservations and eviction."""
        return exclusive(self.layout.bookkeeping_lock)

    # -- space ---------------------------------------------------------------------------------
    def _reserve(self, info: ShardInfo, name: str, size: int, *, prefetch: bool) -> None:
        """Reserve `size` bytes for a download, evicting LRU unpinned shards as needed.

        A reader that finds no room releases this process's idle pins, then raises the pressure
        signal and waits (bounded by `full_timeout`) while other processes release theirs and
        downloads in flight finish. A prefetch never waits: it raises CacheFullError at once."""
        if size > self.limit:
            raise CacheFullError(
                f"cache {self.root}: shard {info.path} ({format_size(size)}) is larger than "
                f"the whole cache limit ({format_size(self.limit)}); raise cache_limit"
            )
        if prefetch and self.pressure.recent():
            raise CacheFullError(f"cache {self.root}: a reader is waiting for room; prefetch backs off")
        deadline = time.monotonic() + self.full_timeout
        waited = False
        while True:
            with self.bookkeeping():
                shortage = self.make_room(name, size, prefetch=prefetch)
                if shortage is None:
                    self.ledger.reserve(name, Reservation(size, os.getpid(), prefetch))
                    return
            if prefetch:
                raise CacheFullError(self._full_message(info, size, shortage))
            if shortage.pinned_here and self.release_idle():
                continue  # this process's idle readers gave up their pins: try again at once
            with self._mutex:
                transient_here = bool(self._releasers) and shortage.pinned_here > 0
            others = shortage.pinned_elsewhere + shortage.reserved
            if (others == 0 and not transient_here) or time.monotonic() >= deadline:
                raise CacheFullError(self._full_message(info, size, shortage))
            if not waited:
                waited = True
                with self._mutex:
                    self.counters["full_waits"] += 1
            self.pressure.raise_()  # other processes: give up idle pins; prefetchers: back off
            time.sleep(POLL_SECONDS)

    def _full_message(self, info: ShardInfo, size: int, s: RoomShortage) -> str:
        return (
            f"cache {self.root}: no room for shard {info.path} ({format_size(size)}): the "
            f"limit is {format_size(self.limit)} and shards being read pin "
            f"{format_size(s.pinned_here)} in this process and {format_size(s.pinned_elsewhere)} "
            f"in others, with {format_size(s.reserved)} of downloads in flight. The cache must "
            f"hold one shard per reading thread on the node plus the downloads in flight: raise "
            f"cache_limit, or lower num_workers or the ranks per node"
        )

    def make_room(self, name: str, size: int, *, prefetch: bool = False) -> RoomShortage | None:
        """Evict until `size` more bytes fit (caller holds the bookkeeping lock); None when
        they fit, else what stands in the way. Least recently used first, shards that no
        reader opened yet last. A prefetch evicts only shards that were read, and must leave
        `reader_reserve` bytes to readers beyond the reservations of other prefetches."""
        ledger = self.ledger
        committed = ledger.entries()
        entries = {n: e.bytes for n, e in committed.items()}
        reserved = prefetching = 0
        for other, reservation in ledger.reservations().items():
            if other == name:
                continue
            if reservation is None or not held_elsewhere(self.layout.lock_of(other)):
                ledger.release_reservation(other)  # its downloader died or finished uncleanly
                continue
            reserved += reservation.bytes
            prefetching += reservation.bytes if reservation.prefetch else 0
        if prefetch and prefetching + size > self.limit - self.reader_reserve:
            return RoomShortage(size, sum(entries.values()) + reserved, 0, 0, reserved)
        total = sum(entries.values()) + reserved
        if total + size > self.limit:
            pinned_here = pinned_elsewhere = 0
            # Shards no reader opened since they arrived (prefetched ahead) go last, and a
            # prefetch never evicts them: it would throw away what it fetched for the readers.
            unread = {n for n, e in committed.items() if ledger.opened_at(n) < e.created}
            for victim in sorted(entries, key=lambda n: (n in unread, ledger.atime(n), n)):
                if total + size <= self.limit:
                    break
                if prefetch and victim in unread:
                    break
                if self._evict(victim) is None:
                    with self._mutex:
                        mine = victim in self._pins
                    if mine:
                        pinned_here += entries[victim]
                    else:
                        pinned_elsewhere += entries[victim]
                    continue
                total -= entries[victim]
            if total + size > self.limit:
                return RoomShortage(size, total, pinned_here, pinned_elsewhere, reserved)
        ledger.note_usage(total + size)
        return None

    def _evict(self, name: str) -> int | None:
        """Remove `name` unless a reader pins it; bytes freed (0 if it was already gone)."""
        path = self.path_of(name)
        if not os.path.exists(path):
            self.ledger.forget(name)
            return 0
        fd = try_exclusive(path)
        if fd is None:
            if not os.path.exists(path):
                self.ledger.forget(name)
                return 0
            return None
        try:
            size = os.fstat(fd).st_size
            os.unlink(path)
            size += unlink_companions(path)
            self.ledger.forget(name)
            self.ledger.note_evicted(name)
            with self._mutex:
                self.counters["evictions"] += 1
                self.counters["bytes_evicted"] += size
            return size
        finally:
            close_fd(fd)

    def close(self) -> None:
        self.release_all()
        with self._mutex:
            watcher, self._watcher = self._watcher, None
            self._releasers = []
        if watcher is not None:
            watcher.stop()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def __del__(self) -> None:
        # A dropped cache handle must not keep its shards pinned (its descriptors are plain ints).
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.release_all()
                if self._watcher is not None:
                    self._watcher.stop()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def hash_file(fd: int, checksum: str) -> str:
    """The checksum of open file `fd`, in the algorithm `checksum` names."""
    return checksum_fd(fd, parse_checksum(checksum)[0])[0]


def unlink_companions(path: str) -> int:
    """Remove the companion files of the shard at `path`; bytes freed."""
    freed = 0
    for suffix in COMPANION_SUFFIXES:
        with contextlib.suppress(FileNotFoundError):
            freed += os.stat(path + suffix).st_size
            os.unlink(path + suffix)
    return freed


def remove_temps(layout: Layout, name: str) -> None:
    """Remove leftover temp files of `name` (caller holds its download lock)."""
    for temp in list(layout.temps_of(name)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


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


__all__ = [
    "COUNTER_NAMES", "Companion", "Fetch", "Releaser", "RoomShortage", "ShardCache", "cache_name",
    "parse_cache_name",
]
