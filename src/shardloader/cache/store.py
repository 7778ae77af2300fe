"""The node's shard cache: one directory on local disk shared by every process on the node.

This module is the reader side: pins, verification and one downloader per shard. The directory
layout is in `layout.py`, the locks in `locks.py`, the bookkeeping in `ledger.py` (made to agree
with the files by `reconcile.py`), downloading into temp files and renaming them into place in
`download.py`, reserving room and eviction in `room.py`, and whole-cache maintenance (`usage`,
`prune`, `verify_all`) in `maintenance.py`.

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
  identity changed: inode, size, mtime or inode change time, see `shardloader.io.identity`), so
  a file damaged since an earlier check, even in place with its mtime put back, is caught,
  removed and fetched again.
* Space: committed shards plus reservations of downloads in flight never exceed `limit`.
  `room.py` reserves room for each download, evicting least recently used unpinned shards;
  when pinned shards leave no room, idle readers give up their pins (in this process and, via
  the pressure signal, in others) while the reader waits a bounded time, and prefetch never
  takes room a waiting reader needs. Only when pins that nobody can give up leave no room does
  `CacheFullError` say so, never a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

import shardloader.cache.range_spend as range_spend
from shardloader.cache.download import Companion, Fetch, download_shard, install, temp_files
from shardloader.cache.layout import CacheLayout, cache_name
from shardloader.cache.ledger import Ledger, LedgerEntry
from shardloader.cache.locks import after_fork_in_child, close_fd, exclusive, pin_file
from shardloader.cache.pressure import PressureSignal, PressureWatcher
from shardloader.cache.reconcile import reconcile
from shardloader.cache.room import reserve
from shardloader.cache.shard_files import hash_file, remove_temps, unlink_companions
from shardloader.cache.space import disk_errors
from shardloader.errors import CacheDiskError
from shardloader.format.index import ShardInfo
from shardloader.io.files import fsync_dir
from shardloader.io.identity import FileIdentity
from shardloader.units import format_size

log = logging.getLogger(__name__)

# Releaser: closes this process's idle shard readers (unpinning them); returns how many.
Releaser = Callable[[], int]

#: This process's counters. peer_download_wait_seconds: time a reader waited for another
#: thread's or process's download of the shard it wanted (its lock); a part of the reading
#: thread's `shard_wait_seconds` (telemetry), which also counts its own downloads.
COUNTER_NAMES = (
    "cache_hits", "cache_misses", "bytes_downloaded", "download_seconds",
    "peer_download_wait_seconds", "verify_seconds", "downloads", "prefetched", "retries",
    "evictions", "bytes_evicted", "corrupt_refetched", "redownloads", "idle_released",
    "full_waits", "bytes_from_cache", "bytes_redownloaded",
)


_LIVE_CACHES: weakref.WeakSet[ShardCache] = weakref.WeakSet()


def _forget_caches_after_fork() -> None:
    for cache in list(_LIVE_CACHES):
        cache._forget_after_fork()


after_fork_in_child(_forget_caches_after_fork)


class ShardCache:
    """A node-level, size-limited, content-addressed cache of verified shard files.

    `reader_reserve` is the room (bytes) prefetch downloads must leave free for readers; the
    capacity check sets it from the configuration (see `capacity.py`). `fresh_after` (unix
    seconds: when the run reading through this cache began) tells `bytes_from_cache` which
    unread shards were prefetched for this run (see `_saved_download`)."""

    def __init__(self, root: str | os.PathLike[str], limit: int, *, full_timeout: float = 30.0,
                 fresh_after: float = 0.0):
        if limit <= 0:
            raise ValueError(f"cache limit must be positive, got {limit}")
        with disk_errors(os.path.abspath(os.fspath(root)), "creating its directories"):
            self.layout = CacheLayout.create(root)
        self.root = self.layout.root
        self.limit = int(limit)
        self.full_timeout = float(full_timeout)
        self.reader_reserve = 0
        self.fresh_after = float(fresh_after)
        self.pressure = PressureSignal(self.layout.pressure_file)
        self._mutex = threading.RLock()
        self._reset_process_state()
        _LIVE_CACHES.add(self)

    # -- per-process state ---------------------------------------------------------------------
    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._ledger: Ledger | None = None
        self._ledger_opening = threading.Lock()  # one thread opens (and reconciles) it
        self._pins: dict[str, list[int]] = {}  # name -> [fd, count]
        self._verified: set[tuple[str, FileIdentity]] = set()  # (name, the file verified)
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
        which is not re-entrant across descriptors. Threads that ask at once (the sidecar fetch
        and a prefetch thread, say) wait for the one that opens it, so the ledger is opened and
        the cache reconciled once per process."""
        if self._pid != os.getpid():
            self._forget_after_fork()
        ledger = self._ledger
        if ledger is not None:
            return ledger
        with self._ledger_opening:
            if self._ledger is None:
                opened = Ledger(self.layout.index_dir, self.root)
                with disk_errors(self.root, "reconciling its ledger with its files",
                                 limit=self.limit):
                    reconcile(self.layout, opened)
                self._ledger = opened
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

    def has_releasers(self) -> bool:
        """True when reader pools of this process registered releasers of idle pins."""
        with self._mutex:
            return bool(self._releasers)

    def pinned_here(self, name: str) -> bool:
        """True while this process pins shard `name`."""
        with self._mutex:
            return name in self._pins

    def count(self, **amounts: float) -> None:
        """Add `amounts` to this process's counters."""
        with self._mutex:
            for counter, amount in amounts.items():
                self.counters[counter] += amount

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
            fd = pin_file(path)
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
            saved = hit and not self.pinned_here(name) and self._saved_download(name)
            with self._mutex:
                held = self._pins.get(name)
                if held is not None:  # another thread pinned it meanwhile: share its pin
                    close_fd(fd)
                    held[1] += 1
                else:
                    self._pins[name] = [fd, 1]
                    if saved:  # this process opens a shard the cache held, no download for it
                        self.counters["bytes_from_cache"] += info.bytes
                self.counters["cache_hits" if hit else "cache_misses"] += 1
            self._touch(name, opened=True)
            return path

    def _saved_download(self, name: str) -> bool:
        """Whether opening the cached shard `name` now saves a download: not when it was
        prefetched for this read (it arrived after `fresh_after` and no reader on the node has
        opened it since), whose bytes count as downloaded already. A shard an earlier run
        fetched, or one another reader opened before, is a saving. Advisory: True when the
        ledger cannot tell."""
        try:
            entry = self.ledger.entry(name)
            if entry is None or entry.created < self.fresh_after:
                return True
            return self.ledger.opened_at(name) >= entry.created
        except Exception:  # noqa: BLE001 - a counter never fails a read
            log.debug("cache %s: could not tell how %s arrived", self.root, name, exc_info=True)
            return True

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
        key = (name, FileIdentity.of(st))
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
        with exclusive(self.layout.lock_of(name)):
            self.discard_locked(name, identity)

    def discard_locked(self, name: str, identity: tuple[int, int]) -> None:
        """`discard`, the caller holding the download lock of `name` (a sidecar's filler)."""
        path = self.path_of(name)
        with self.bookkeeping():
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
        doing = f"downloading shard {info.path} ({format_size(info.bytes)}) into {self.layout.tmp_dir}"
        with disk_errors(self.root, doing, path=self.layout.tmp_dir, limit=self.limit), \
                exclusive(self.layout.lock_of(name), on_wait=None if prefetch else self._count_wait):
            if os.path.exists(path):
                return "hit"
            remove_temps(self.layout, name)
            reserve(self, info, name, info.bytes + sum(c.bytes for c in companions), prefetch=prefetch)
            committed = False
            try:
                with temp_files(self.layout, name) as new_temp:
                    tmp, stats, st, kept = download_shard(new_temp, info, path, fetch, companions, cancel)
                    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                    with self.bookkeeping():
                        install(tmp, path, kept)
                        committed = True
                        # its identity after the rename, which moved its change time (no one
                        # else can replace or evict it while these locks are held)
                        st = os.stat(path)
                        size = info.bytes + sum(n for _, _, n in kept)
                        self.ledger.commit(name, LedgerEntry(size, time.time()))
                        again = self.ledger.note_download(name, stats.bytes_received)
                    fsync_dir(os.path.dirname(path))
                    range_spend.forget(self.layout, name)  # whole: reads by range are over
                    with self._mutex:
                        self._verified.add((name, FileIdentity.of(st)))
                        self.counters["bytes_downloaded"] += stats.bytes_received
                        self.counters["download_seconds"] += stats.seconds
                        self.counters["retries"] += stats.retries
                        self.counters["downloads"] += 1
                        self.counters["redownloads"] += int(again)
                        self.counters["bytes_redownloaded"] += stats.bytes_received if again else 0
                        if prefetch:
                            self.counters["prefetched"] += 1
                    return "downloaded"
            finally:
                if not committed:
                    try:
                        with self.bookkeeping():
                            self.ledger.release_reservation(name)
                    except CacheDiskError:  # the disk refused: the error in flight says so, and
                        log.debug("cache %s: reservation of %s left", self.root, name, exc_info=True)
                        # the next room-making pass drops the reservation (its lock is free)

    def _count_wait(self, seconds: float) -> None:
        with self._mutex:
            self.counters["peer_download_wait_seconds"] += seconds

    def bookkeeping(self) -> contextlib.AbstractContextManager[None]:
        """The node-wide lock over sizes, reservations and eviction."""
        return exclusive(self.layout.bookkeeping_lock)

    def close(self) -> None:
        self.release_all()
        with self._mutex:
            watcher, self._watcher = self._watcher, None
            self._releasers = []
        if watcher is not None:
            watcher.stop()
        # Under the opening lock: a thread opening the ledger meanwhile finishes first, and the
        # ledger it opened is closed here, not left open behind a closed cache.
        with self._ledger_opening:
            ledger, self._ledger = self._ledger, None
        if ledger is not None:
            ledger.close()

    def __del__(self) -> None:
        # A dropped cache handle must not keep its shards pinned (its descriptors are plain ints).
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.release_all()
                if self._watcher is not None:
                    self._watcher.stop()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


__all__ = ["COUNTER_NAMES", "Releaser", "ShardCache"]
