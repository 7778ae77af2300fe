"""The node's shard cache: one directory on local disk shared by every process on the node.

Layout (every directory created owner-only, every file 0600)::

    <root>/data/<d[:2]>/<algorithm>-<digest>.<format>   whole, verified shards (content-addressed)
    <root>/tmp/<name>.<pid>.<token>.part               downloads in progress (never read)
    <root>/locks/<name>.lock                            per-shard download lock (flock)
    <root>/locks/bookkeeping.lock                       guards sizes, reservations, eviction
    <root>/index/                                       diskcache: sizes, access times, reservations

Rules that make the cache trustworthy (design invariant I6):

* A shard reaches its final name only by `rename` of a temp file that was downloaded, hashed to
  the index checksum and fsynced, so a name in `data/` always holds a whole file.
* Only the holder of a shard's download lock (an exclusive `flock` on `locks/<name>.lock`) writes
  temp files of that shard, so exactly one process downloads a shard at a time; the others block
  on the lock and then find the file. The lock file persists and is empty; correctness never
  depends on its content, and the kernel drops the lock when its holder dies, so a killed
  process leaves nothing to clean up (its temp files are removed by the next lock holder).
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
  recently used unpinned shards; when pinned shards alone leave no room, `CacheFullError` says
  so (after waiting a bounded time for other processes to release theirs), never a hang.

File names are built only from the checksum (algorithm from a fixed list, digest checked to be
lowercase hex) and the shard format (from a fixed list): nothing taken from the index is used as
a path without validation.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shardloader.cache.fetch import FetchStats, hash_fd
from shardloader.errors import CacheFullError, ShardError, ShardloaderError
from shardloader.format.checksum import parse_checksum
from shardloader.format.index import SHARD_FORMATS, ShardInfo
from shardloader.units import format_size

_ALGORITHMS = ("xxh3_128", "blake2b")
_NAME = re.compile(
    r"^(?P<algorithm>" + "|".join(_ALGORITHMS) + r")-(?P<digest>[0-9a-f]{16,128})"
    r"\.(?P<format>" + "|".join(SHARD_FORMATS) + r")$"
)
_TEMP = re.compile(r"^(?P<name>[^/]+)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]+)\.part$")
log = logging.getLogger(__name__)
_DIR_MODE = 0o700
_FILE_MODE = 0o600

# Fetch callback: write the shard into an open, empty file descriptor; may raise FetchError or
# FetchCancelled; returns what it cost.
Fetch = Callable[[int, "threading.Event | None"], FetchStats]
COMPANION_SUFFIXES = (".idx",)  # files kept next to a shard (a tar's offsets sidecar)


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

COUNTER_NAMES = (
    "cache_hits", "cache_misses", "bytes_downloaded", "download_seconds", "wait_seconds",
    "verify_seconds", "downloads", "prefetched", "retries", "evictions", "bytes_evicted",
    "corrupt_refetched",
)


def cache_name(info: ShardInfo) -> str:
    """The content-addressed file name of shard `info`, from validated parts only."""
    try:
        algorithm, digest = parse_checksum(info.checksum)
    except ValueError as e:
        raise ShardError(f"{info.path}: {e}") from None
    name = f"{algorithm}-{digest}.{info.format}"
    if not _NAME.match(name):
        raise ShardError(
            f"{info.path}: checksum {info.checksum!r} cannot name a cache file (the digest must "
            f"be 16-128 lowercase hex digits, the algorithm one of {', '.join(_ALGORITHMS)})"
        )
    return name


def parse_cache_name(name: str) -> tuple[str, str] | None:
    """(checksum, format) for a valid cache file name, else None."""
    match = _NAME.match(name)
    if match is None:
        return None
    return f"{match['algorithm']}:{match['digest']}", match["format"]


@dataclass(frozen=True)
class RoomShortage:
    """Why a reservation did not fit: bytes pinned by this process, by others, in flight."""

    needed: int
    total: int
    pinned_here: int
    pinned_elsewhere: int
    reserved: int


_LIVE_CACHES: weakref.WeakSet[ShardCache] = weakref.WeakSet()
# Every descriptor that may carry a flock (pins, download and bookkeeping locks). A forked child
# inherits them and, with them, the locks: a worker forked while the prefetcher holds a download
# lock would keep that lock for its whole life. The child closes its copies at once (the parent
# keeps its own, so the parent's locks are unaffected).
_LOCK_FDS: set[int] = set()
_LOCK_FDS_GUARD = threading.RLock()  # re-entrant: __del__ may run while it is held


def _open_fd(path: str, flags: int, mode: int = _FILE_MODE) -> int:
    fd = os.open(path, flags, mode)
    with _LOCK_FDS_GUARD:
        _LOCK_FDS.add(fd)
    return fd


def _close_fd(fd: int) -> None:
    with _LOCK_FDS_GUARD:
        _LOCK_FDS.discard(fd)
    os.close(fd)


def _after_fork_in_child() -> None:
    global _LOCK_FDS_GUARD
    _LOCK_FDS_GUARD = threading.RLock()  # another thread may have held it at the fork
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    for cache in list(_LIVE_CACHES):
        cache._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ShardCache:
    """A node-level, size-limited, content-addressed cache of verified shard files."""

    def __init__(self, root: str | os.PathLike[str], limit: int, *, full_timeout: float = 30.0):
        if limit <= 0:
            raise ValueError(f"cache limit must be positive, got {limit}")
        self.root = os.path.abspath(os.fspath(root))
        self.limit = int(limit)
        self.full_timeout = float(full_timeout)
        self.data_dir = os.path.join(self.root, "data")
        self.tmp_dir = os.path.join(self.root, "tmp")
        self.lock_dir = os.path.join(self.root, "locks")
        self.index_dir = os.path.join(self.root, "index")
        for d in (self.root, self.data_dir, self.tmp_dir, self.lock_dir, self.index_dir):
            _make_private_dir(d)
        self._mutex = threading.RLock()
        self._opened = threading.Condition(self._mutex)  # notified on every reader open
        self._reset_process_state()
        _LIVE_CACHES.add(self)

    # -- per-process state ---------------------------------------------------------------------
    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._index: Any = None
        self._pins: dict[str, list[int]] = {}  # name -> [fd, count]
        self._verified: set[tuple[str, int, int, int]] = set()  # (name, ino, size, mtime_ns)
        self._reconciled = False
        self.counters: dict[str, float] = dict.fromkeys(COUNTER_NAMES, 0)

    def _forget_after_fork(self) -> None:
        """In a forked child: forget inherited pins (their descriptors were closed by the fork
        hook; the parent keeps its own pins) and the per-process state."""
        self._mutex = threading.RLock()
        self._opened = threading.Condition(self._mutex)
        self._reset_process_state()

    def _ready(self) -> Any:
        """The index of this process, opened (and the cache reconciled) on first use.

        Public methods call this before taking any lock: reconciling takes the bookkeeping lock,
        which is not re-entrant across descriptors."""
        if self._pid != os.getpid():
            self._forget_after_fork()
        if self._index is None:
            import diskcache

            self._index = diskcache.Cache(
                self.index_dir, eviction_policy="none", size_limit=2**62, statistics=False,
                tag_index=False,
            )
            self.reconcile()
        return self._index

    @property
    def index(self) -> Any:
        return self._ready()

    # -- paths ---------------------------------------------------------------------------------
    def path_of(self, name: str) -> str:
        digest = name.split("-", 1)[1]
        return os.path.join(self.data_dir, digest[:2], name)

    def path_for(self, info: ShardInfo) -> str:
        return self.path_of(cache_name(info))

    def _lock_path(self, name: str) -> str:
        return os.path.join(self.lock_dir, name + ".lock")

    # -- reading: open (pin) and release -------------------------------------------------------
    def open(self, info: ShardInfo, fetch: Fetch, companions: tuple[Companion, ...] = ()) -> str:
        """A pinned local path to the whole, verified file of `info`, fetching it if needed.

        The shard stays pinned (never evicted) until `release(info)` is called as many times
        as `open`.
        """
        self._ready()
        name = cache_name(info)
        path = self.path_of(name)
        with self._mutex:
            pin = self._pins.get(name)
            if pin is not None:
                pin[1] += 1
                self.counters["cache_hits"] += 1
                return path
        hit = True
        while True:
            fd = self._try_pin(path)
            if fd is None:
                hit = False
                self._fill(info, name, fetch, companions, prefetch=False, cancel=None)
                continue
            try:
                if not self._check(info, name, fd):
                    _close_fd(fd)
                    fd = None
                    with self._mutex:
                        self.counters["corrupt_refetched"] += 1
                    hit = False
                    continue
            except BaseException:
                if fd is not None:
                    _close_fd(fd)
                raise
            with self._mutex:
                pin = self._pins.get(name)
                if pin is not None:  # another thread pinned it meanwhile: share its pin
                    _close_fd(fd)
                    pin[1] += 1
                else:
                    self._pins[name] = [fd, 1]
                self.counters["cache_hits" if hit else "cache_misses"] += 1
            self._touch(name, opened=True)
            with self._opened:
                self._opened.notify_all()
            return path

    def release(self, info: ShardInfo) -> None:
        """Undo one `open(info)`; the last release unpins the shard (it may be evicted)."""
        name = cache_name(info)
        with self._mutex:
            pin = self._pins.get(name)
            if pin is None:
                return
            pin[1] -= 1
            if pin[1] > 0:
                return
            del self._pins[name]
            _close_fd(pin[0])
        self._touch(name)

    def _touch(self, name: str, *, opened: bool = False) -> None:
        """Record an access (LRU order) and, for a reader, the open (the prefetcher's signal).
        Advisory: a failure here must not lose a pin or fail a read."""
        now = time.time()
        try:
            self.index.set("atime/" + name, now)
            if opened:
                self.index.set("opened/" + name, now)
        except Exception:  # noqa: BLE001 - e.g. sqlite busy for longer than its timeout
            log.warning("cache %s: could not record an access to %s", self.root, name, exc_info=True)

    def release_all(self) -> None:
        with self._mutex:
            pins, self._pins = self._pins, {}
        for fd, _ in pins.values():
            with contextlib.suppress(OSError):
                _close_fd(fd)

    def pinned(self) -> list[str]:
        with self._mutex:
            return sorted(self._pins)

    def _try_pin(self, path: str) -> int | None:
        """An fd holding a shared lock on the file now at `path`, or None if there is none."""
        try:
            fd = _open_fd(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            mine = os.fstat(fd)
            if current is None or (current.st_ino, current.st_dev) != (mine.st_ino, mine.st_dev):
                _close_fd(fd)  # evicted or replaced between open and lock
                return None
            return fd
        except BaseException:
            with contextlib.suppress(OSError):
                _close_fd(fd)
            raise

    def _check(self, info: ShardInfo, name: str, fd: int) -> bool:
        """Verify the pinned file once per process; discard it and return False if it is bad."""
        st = os.fstat(fd)
        key = (name, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._mutex:
            if key in self._verified:
                return True
        start = time.monotonic()
        ok = st.st_size == info.bytes and _hash_fd(fd, info.checksum) == info.checksum
        with self._mutex:
            self.counters["verify_seconds"] += time.monotonic() - start
            if ok:
                self._verified.add(key)
        if not ok:
            self._discard(name, (st.st_ino, st.st_dev))
        return ok

    def _discard(self, name: str, identity: tuple[int, int]) -> None:
        """Remove a damaged cached file, unless someone already replaced it."""
        path = self.path_of(name)
        with self._download_lock(name), self._bookkeeping():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return
            if (st.st_ino, st.st_dev) == identity:
                os.unlink(path)
                self._unlink_companions(path)
                self._forget(name)

    # -- prefetch: make present without pinning -----------------------------------------------
    def ensure(
        self, info: ShardInfo, fetch: Fetch, companions: tuple[Companion, ...] = (),
        cancel: threading.Event | None = None,
    ) -> str:
        """Make `info` present in the cache (no pin, no verification by this process).

        Returns "hit" or "downloaded". Raises CacheFullError at once when there is no room now
        (a prefetcher waits and tries again later), FetchError, FetchCancelled.
        """
        self._ready()
        name = cache_name(info)
        if os.path.exists(self.path_of(name)):
            self._touch(name)
            return "hit"
        return self._fill(info, name, fetch, companions, prefetch=True, cancel=cancel)

    def opened_at(self, info: ShardInfo) -> float:
        """Wall-clock time of the latest reader open of `info` on this node (0 if never)."""
        return float(self.index.get("opened/" + cache_name(info), 0.0))

    def wait_for_open(self, timeout: float) -> None:
        """Block until a reader in this process opens a shard, or `timeout` seconds pass."""
        with self._opened:
            self._opened.wait(timeout)

    # -- filling: one downloader per shard -----------------------------------------------------
    def _fill(
        self, info: ShardInfo, name: str, fetch: Fetch, companions: tuple[Companion, ...], *,
        prefetch: bool, cancel: threading.Event | None,
    ) -> str:
        path = self.path_of(name)
        with self._download_lock(name, waited=not prefetch):
            if os.path.exists(path):
                return "hit"
            self._remove_temps(name)
            self._reserve(info, name, info.bytes + sum(c.bytes for c in companions), prefetch=prefetch)
            temps: list[str] = []
            committed = False
            try:
                tmp = self._new_temp(name, temps)
                stats, st = self._download_into(tmp, fetch, cancel, info.bytes, info.path)
                kept: list[tuple[str, str, int]] = []  # (temp, final path, bytes)
                for companion in companions:
                    ctmp = self._new_temp(name, temps)
                    try:
                        cstats, _ = self._download_into(
                            ctmp, companion.fetch, cancel, companion.bytes, info.path + companion.suffix
                        )
                    except ShardloaderError as e:  # optional: its reader can do without it
                        log.warning("%s: companion %s not cached: %s", info.path, companion.suffix, e)
                        continue
                    stats.bytes_received += cstats.bytes_received
                    stats.seconds += cstats.seconds
                    kept.append((ctmp, path + companion.suffix, companion.bytes))
                os.makedirs(os.path.dirname(path), mode=_DIR_MODE, exist_ok=True)
                with self._bookkeeping():
                    for ctmp, final, _ in kept:  # companions first: the shard's name is the commit
                        os.rename(ctmp, final)
                    os.rename(tmp, path)
                    committed = True
                    now = time.time()
                    size = info.bytes + sum(n for _, _, n in kept)
                    self._index.set("entry/" + name, {"bytes": size, "created": now})
                    self._index.set("atime/" + name, now)
                    self._index.delete("resv/" + name)
                _fsync_dir(os.path.dirname(path))
                with self._mutex:
                    self._verified.add((name, st.st_ino, st.st_size, st.st_mtime_ns))
                    self.counters["bytes_downloaded"] += stats.bytes_received
                    self.counters["download_seconds"] += stats.seconds
                    self.counters["retries"] += stats.retries
                    self.counters["downloads"] += 1
                    if prefetch:
                        self.counters["prefetched"] += 1
                return "downloaded"
            finally:
                for temp in temps:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temp)
                if not committed:
                    with self._bookkeeping():
                        self._index.delete("resv/" + name)

    def _new_temp(self, name: str, temps: list[str]) -> str:
        tmp = os.path.join(self.tmp_dir, f"{name}.{os.getpid()}.{secrets.token_hex(6)}.part")
        temps.append(tmp)
        return tmp

    @staticmethod
    def _download_into(
        tmp: str, fetch: Fetch, cancel: threading.Event | None, size: int, what: str
    ) -> tuple[FetchStats, os.stat_result]:
        """Fetch into a new owner-only temp file, check its size, fsync it."""
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
        try:
            stats = fetch(fd, cancel)
            os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if st.st_size != size:
            raise ShardError(f"{what}: download wrote {st.st_size} bytes, expected {size}")
        return stats, st

    @contextlib.contextmanager
    def _download_lock(self, name: str, *, waited: bool = False) -> Iterator[None]:
        fd = _open_fd(self._lock_path(name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                start = time.monotonic()
                fcntl.flock(fd, fcntl.LOCK_EX)  # someone else is downloading it: wait for them
                if waited:
                    with self._mutex:
                        self.counters["wait_seconds"] += time.monotonic() - start
            yield
        finally:
            _close_fd(fd)  # closing the only descriptor drops the lock

    @contextlib.contextmanager
    def _bookkeeping(self) -> Iterator[None]:
        fd = _open_fd(
            os.path.join(self.lock_dir, "bookkeeping.lock"),
            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE,
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _close_fd(fd)

    def _is_locked_elsewhere(self, name: str) -> bool:
        """True while some open file description holds `name`'s download lock."""
        try:
            fd = _open_fd(self._lock_path(name), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            _close_fd(fd)

    def _remove_temps(self, name: str) -> None:
        """Remove leftover temp files of `name` (caller holds its download lock)."""
        prefix = name + "."
        for entry in os.listdir(self.tmp_dir):
            match = _TEMP.match(entry)
            if match and match["name"] == name and entry.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.tmp_dir, entry))

    # -- space ---------------------------------------------------------------------------------
    def _reserve(self, info: ShardInfo, name: str, size: int, *, prefetch: bool) -> None:
        """Reserve `size` bytes for a download, evicting LRU unpinned shards as needed."""
        if size > self.limit:
            raise CacheFullError(
                f"cache {self.root}: shard {info.path} ({format_size(size)}) is larger than "
                f"the whole cache limit ({format_size(self.limit)}); raise cache_limit"
            )
        deadline = time.monotonic() + self.full_timeout
        while True:
            with self._bookkeeping():
                shortage = self._make_room(name, size)
                if shortage is None:
                    self._index.set("resv/" + name, {"bytes": size, "pid": os.getpid()})
                    return
            others = shortage.pinned_elsewhere + shortage.reserved
            if prefetch or others == 0 or time.monotonic() >= deadline:
                raise CacheFullError(self._full_message(info, size, shortage))
            time.sleep(0.05)  # other processes hold pins or downloads: they will release them

    def _full_message(self, info: ShardInfo, size: int, s: RoomShortage) -> str:
        return (
            f"cache {self.root}: no room for shard {info.path} ({format_size(size)}): the "
            f"limit is {format_size(self.limit)} and shards being read pin "
            f"{format_size(s.pinned_here)} in this process and {format_size(s.pinned_elsewhere)} "
            f"in others, with {format_size(s.reserved)} of downloads in flight. The cache must "
            f"hold every shard open at once (readers x max_open_shards, plus the prefetch "
            f"window): raise cache_limit or read fewer shards at once"
        )

    def _make_room(self, name: str, size: int) -> RoomShortage | None:
        """Evict until `size` more bytes fit (caller holds the bookkeeping lock)."""
        index = self.index
        entries: dict[str, int] = {}
        reserved = 0
        for key in list(index.iterkeys()):
            kind, _, other = str(key).partition("/")
            if kind == "entry":
                value = index.get(key)
                if isinstance(value, dict) and isinstance(value.get("bytes"), int):
                    entries[other] = value["bytes"]
            elif kind == "resv" and other != name:
                value = index.get(key)
                if not isinstance(value, dict) or not self._is_locked_elsewhere(other):
                    index.delete(key)  # its downloader died or finished without cleaning up
                elif isinstance(value.get("bytes"), int):
                    reserved += value["bytes"]
        total = sum(entries.values()) + reserved
        if total + size <= self.limit:
            return None
        pinned_here = pinned_elsewhere = 0
        by_age = sorted(entries, key=lambda n: (float(index.get("atime/" + n, 0.0)), n))
        for victim in by_age:
            if total + size <= self.limit:
                return None
            freed = self._evict(victim)
            if freed is None:
                with self._mutex:
                    mine = victim in self._pins
                if mine:
                    pinned_here += entries[victim]
                else:
                    pinned_elsewhere += entries[victim]
                continue
            total -= entries[victim]
        if total + size <= self.limit:
            return None
        return RoomShortage(size, total, pinned_here, pinned_elsewhere, reserved)

    def _evict(self, name: str) -> int | None:
        """Remove `name` unless a reader pins it; bytes freed (0 if it was already gone)."""
        path = self.path_of(name)
        try:
            fd = _open_fd(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(name)
            return 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            size = os.fstat(fd).st_size
            os.unlink(path)
            size += self._unlink_companions(path)
            self._forget(name)
            with self._mutex:
                self.counters["evictions"] += 1
                self.counters["bytes_evicted"] += size
            return size
        finally:
            _close_fd(fd)

    @staticmethod
    def _unlink_companions(path: str) -> int:
        freed = 0
        for suffix in COMPANION_SUFFIXES:
            with contextlib.suppress(FileNotFoundError):
                freed += os.stat(path + suffix).st_size
                os.unlink(path + suffix)
        return freed

    def _forget(self, name: str) -> None:
        for kind in ("entry", "atime", "opened"):
            self.index.delete(f"{kind}/{name}")

    # -- consistency ---------------------------------------------------------------------------
    def reconcile(self) -> None:
        """Make the index agree with the files: add shards it lacks (a process killed between
        rename and bookkeeping), drop entries whose file is gone, and remove temp files whose
        downloader is dead. Runs once per process, when the index is first used."""
        with self._bookkeeping():
            index = self._index
            present: dict[str, os.stat_result] = {}
            for name, path in self._data_files():
                with contextlib.suppress(FileNotFoundError):
                    present[name] = os.stat(path)
            for key in list(index.iterkeys()):
                kind, _, name = str(key).partition("/")
                if kind == "entry" and name not in present:
                    self._forget(name)
            for name, st in present.items():
                if index.get("entry/" + name) is None:
                    size = st.st_size
                    for suffix in COMPANION_SUFFIXES:
                        with contextlib.suppress(FileNotFoundError):
                            size += os.stat(self.path_of(name) + suffix).st_size
                    index.set("entry/" + name, {"bytes": size, "created": st.st_mtime})
                    index.set("atime/" + name, st.st_mtime)
            for path in self._orphan_companions():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        for entry in os.listdir(self.tmp_dir):
            match = _TEMP.match(entry)
            if match is None or parse_cache_name(match["name"]) is None:
                continue
            name = match["name"]
            try:
                fd = _open_fd(self._lock_path(name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._remove_temps(name)
            except BlockingIOError:
                pass  # being downloaded right now
            finally:
                _close_fd(fd)

    def _data_files(self) -> Iterator[tuple[str, str]]:
        for sub in sorted(os.listdir(self.data_dir)):
            subdir = os.path.join(self.data_dir, sub)
            if not os.path.isdir(subdir) or os.path.islink(subdir):
                continue
            for name in sorted(os.listdir(subdir)):
                if parse_cache_name(name) is not None and name.split("-", 1)[1][:2] == sub:
                    yield name, os.path.join(subdir, name)

    def _orphan_companions(self) -> Iterator[str]:
        """Companion files whose shard is absent and not being downloaded."""
        for sub in sorted(os.listdir(self.data_dir)):
            subdir = os.path.join(self.data_dir, sub)
            if not os.path.isdir(subdir) or os.path.islink(subdir):
                continue
            for entry in os.listdir(subdir):
                for suffix in COMPANION_SUFFIXES:
                    main = entry[: -len(suffix)]
                    if (
                        entry.endswith(suffix) and parse_cache_name(main) is not None
                        and not os.path.exists(os.path.join(subdir, main))
                        and not self._is_locked_elsewhere(main)
                    ):
                        yield os.path.join(subdir, entry)

    # -- inspection ----------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        """Bytes and files on disk now: committed shards and temp files."""
        data = files = 0
        for _, path in self._data_files():
            with contextlib.suppress(FileNotFoundError):
                data += os.stat(path).st_size
                files += 1
            for suffix in COMPANION_SUFFIXES:
                with contextlib.suppress(FileNotFoundError):
                    data += os.stat(path + suffix).st_size
        tmp = 0
        for entry in os.listdir(self.tmp_dir):
            with contextlib.suppress(FileNotFoundError):
                tmp += os.stat(os.path.join(self.tmp_dir, entry)).st_size
        return {"data_bytes": data, "files": files, "tmp_bytes": tmp, "limit": self.limit}

    def prune(self, target: int) -> dict[str, int]:
        """Evict least recently used unpinned shards until at most `target` bytes remain.

        Returns counts: evicted, bytes_freed, remaining (pinned shards and downloads in flight
        stay, so `remaining` may be above `target`)."""
        self._ready()
        before = dict(self.counters)
        with self._bookkeeping():
            shortage = self._make_room("", max(0, self.limit - target)) if target < self.limit else None
            remaining = shortage.total if shortage is not None else None
        if remaining is None:
            remaining = sum(
                int(v.get("bytes", 0)) for k in list(self._index.iterkeys())
                if str(k).startswith("entry/") and isinstance(v := self._index.get(k), dict)
            )
        return {
            "evicted": int(self.counters["evictions"] - before["evictions"]),
            "bytes_freed": int(self.counters["bytes_evicted"] - before["bytes_evicted"]),
            "remaining": int(remaining),
        }

    def verify_all(self, *, remove: bool = False) -> Iterator[tuple[str, str, str]]:
        """Re-hash every cached file: yields (path, status, detail), status 'ok' or 'corrupt'.

        With `remove`, a corrupt file is deleted (under its download lock) so the next reader
        fetches it again.
        """
        self._ready()
        for name, path in self._data_files():
            checksum, _ = parse_cache_name(name)  # type: ignore[misc]
            try:
                fd = _open_fd(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                actual = _hash_fd(fd, checksum)
                identity = (os.fstat(fd).st_ino, os.fstat(fd).st_dev)
            finally:
                _close_fd(fd)
            if actual == checksum:
                yield path, "ok", ""
                continue
            detail = f"hashes to {actual}, its name says {checksum}"
            if remove:
                self._discard(name, identity)
                detail += " (removed)"
            yield path, "corrupt", detail

    def close(self) -> None:
        self.release_all()
        if self._index is not None:
            self._index.close()
            self._index = None

    def __del__(self) -> None:
        # A dropped cache handle must not keep its shards pinned (its descriptors are plain ints).
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.release_all()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def _hash_fd(fd: int, checksum: str) -> str:
    return hash_fd(fd, parse_checksum(checksum)[0])


def _make_private_dir(path: str) -> None:
    try:
        os.mkdir(path, _DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "cache path exists and is not a directory", path) from None
    except FileNotFoundError:
        os.makedirs(path, mode=_DIR_MODE, exist_ok=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
