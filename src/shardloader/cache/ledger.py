"""The cache's ledger: what the node cache holds, reserves and did, in a diskcache database.

The ledger is bookkeeping, not truth: the files under `data/` are the truth, and
`reconcile.reconcile` makes the ledger agree with them when a process first opens the cache.
Every read and write of the database goes through this class, with typed records:

* `LedgerEntry` per committed shard (bytes with companions, creation time), plus its last access
  time (LRU order) and its last reader open (the prefetcher's signal that a shard was consumed);
* `Reservation` per download in flight (bytes, downloader pid, whether it is a prefetch); valid
  only while the shard's download lock is held (making room drops stale ones, see `room.py`);
* node-wide counters (downloads, re-downloads of shards evicted earlier, evictions) and the
  high-water mark of committed plus reserved bytes, which proves the limit held.

Writers that change sizes or reservations hold the bookkeeping lock (see `locks.py`); the
database itself is safe for many processes (sqlite). A write the filesystem refuses (read-only, full) is a CacheDiskError
naming the cache, the record and the free space (see `space.py`).
"""

from __future__ import annotations

import ctypes
import os
import sqlite3
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardloader.cache.space import disk_errors

# sqlite must not be inside a call in any thread when the process forks: a child that inherits
# one of sqlite's internal mutexes locked hangs in its first sqlite call (seen: a loader worker
# forked while the parent's prefetch thread polled the ledger never produced a batch). Every
# database call holds this lock, and a fork waits for it (os.register_at_fork below).
_SQLITE_GUARD = threading.RLock()

# Nor may a connection cross a fork, not even to be closed: a child's copy of it believes it
# holds the parent's locks, and closing it may checkpoint and delete the write-ahead log the
# other processes use ("database disk image is malformed", seen with 4 workers). Python closes
# a connection it frees, and a child frees what it inherited without asking (a ledger a worker
# drops to open its own; a connection left in a reference cycle). So each ledger has one
# connection per process, shared by its threads (every call holds the guard above; diskcache
# would keep one per thread, and a thread's ends with it, whenever the collector gets to it),
# and every open one is held here: a forked child keeps its inherited ones open for good (one
# reference leaked on purpose, so that not even the interpreter's exit frees them).
_OPEN: dict[int, sqlite3.Connection] = {}


def _in_child() -> None:
    global _SQLITE_GUARD
    _SQLITE_GUARD = threading.RLock()
    for con in _OPEN.values():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(con))  # never freed, so never closed
    _OPEN.clear()


os.register_at_fork(before=lambda: _SQLITE_GUARD.acquire(),
                    after_in_parent=lambda: _SQLITE_GUARD.release(),
                    after_in_child=_in_child)


#: What sqlite's write-ahead log may take on disk (its default checkpointing at 1000 pages: about
#: 4 MiB); `space.DISK_MARGIN` leaves room for it.
LEDGER_WAL_BYTES = 4 << 20
_DOING = {"set": "writing", "delete": "deleting", "incr": "updating", "pop": "removing",
          "get": "reading", "iterkeys": "listing", "close": "closing"}


class _GuardedCache:
    """A diskcache.Cache whose every call holds the fork guard, with one sqlite connection per
    process for all its threads (see `_OPEN`), and whose refusals by the filesystem
    (read-only, full) are CacheDiskErrors naming the cache and the record."""

    def __init__(self, directory: str, root: str) -> None:

        self._directory, self._root = directory, root
        self._open()

    def _open(self) -> None:
        import diskcache

        self._pid = os.getpid()
        with _SQLITE_GUARD, disk_errors(self._root, f"opening its ledger in {self._directory}",
                                        path=self._directory):
            cache = diskcache.Cache(self._directory, eviction_policy="none", size_limit=2**62,
                                    statistics=False, tag_index=False)
            cache.close()  # the connection diskcache made for this thread: replaced by one for all
            shared = types.SimpleNamespace(pid=self._pid)
            shared.con = sqlite3.connect(os.path.join(self._directory, diskcache.core.DBNAME),
                                         timeout=cache._timeout, isolation_level=None,
                                         check_same_thread=False)
            _OPEN[id(shared.con)] = shared.con
            cache._local = shared  # what diskcache looks its connection up in (a threading.local)
            for key, value in shared.con.execute("SELECT key, value FROM Settings").fetchall():
                if key.startswith("sqlite_"):  # per-connection pragmas, as diskcache sets them
                    cache.reset(key, value, update=False)
            self._cache = cache

    def __getattr__(self, name: str) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            record = f" record {args[0]!r}" if args and isinstance(args[0], str) else "s"
            doing = f"{_DOING.get(name, name)} the ledger{record} in {self._directory}"
            with _SQLITE_GUARD, disk_errors(self._root, doing, path=self._directory):
                if self._pid != os.getpid():
                    # Inherited across a fork: diskcache would close the parent's connection
                    # here. Leave it (held open, above) and open this process's own.
                    if name == "close":
                        return None
                    self._open()
                elif name != "close" and getattr(self._cache._local, "con", None) is None:
                    self._open()  # closed earlier: diskcache would open one for this thread only
                if name == "close":
                    con = getattr(self._cache._local, "con", None)
                    if con is not None:
                        _OPEN.pop(id(con), None)
                result = getattr(self._cache, name)(*args, **kwargs)
                return list(result) if name == "iterkeys" else result

        return guarded

_ENTRY, _ATIME, _OPENED, _RESERVED, _EVICTED, _STAT = "entry", "atime", "opened", "resv", "evicted", "stat"
NODE_COUNTERS = ("downloads", "redownloads", "evictions", "bytes_downloaded")


@dataclass(frozen=True)
class LedgerEntry:
    """A committed shard: its bytes (companion files included) and when it was committed."""

    bytes: int
    created: float


@dataclass(frozen=True)
class Reservation:
    """Room held for a download in flight."""

    bytes: int
    pid: int
    prefetch: bool = False


def _key(kind: str, name: str) -> str:
    return f"{kind}/{name}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class Ledger:
    """Typed access to the cache's diskcache database in `directory` (of the cache at `root`,
    named in errors; default: the parent of `directory`)."""

    def __init__(self, directory: str, root: str | None = None) -> None:
        self._db = _GuardedCache(directory, root or os.path.dirname(os.path.abspath(directory)))

    def _scan(self, kind: str) -> Iterator[tuple[str, Any]]:
        prefix = kind + "/"
        for key in list(self._db.iterkeys()):
            if isinstance(key, str) and key.startswith(prefix):
                yield key[len(prefix):], self._db.get(key)

    # -- committed shards ----------------------------------------------------------------------
    def entries(self) -> dict[str, LedgerEntry]:
        out = {}
        for name, value in self._scan(_ENTRY):
            if isinstance(value, dict) and _int(value.get("bytes")) is not None:
                out[name] = LedgerEntry(value["bytes"], float(value.get("created", 0.0)))
        return out

    def entry(self, name: str) -> LedgerEntry | None:
        value = self._db.get(_key(_ENTRY, name))
        if isinstance(value, dict) and _int(value.get("bytes")) is not None:
            return LedgerEntry(value["bytes"], float(value.get("created", 0.0)))
        return None

    def commit(self, name: str, entry: LedgerEntry) -> None:
        """Record a committed shard (replacing its reservation), accessed now."""
        self._db.set(_key(_ENTRY, name), {"bytes": entry.bytes, "created": entry.created})
        self._db.set(_key(_ATIME, name), entry.created)
        self._db.delete(_key(_RESERVED, name))

    def forget(self, name: str) -> None:
        """Drop everything known about a shard that is no longer cached."""
        for kind in (_ENTRY, _ATIME, _OPENED):
            self._db.delete(_key(kind, name))

    def touch(self, name: str, now: float, *, opened: bool = False) -> None:
        self._db.set(_key(_ATIME, name), now)
        if opened:
            self._db.set(_key(_OPENED, name), now)

    def atime(self, name: str) -> float:
        value = self._db.get(_key(_ATIME, name), 0.0)
        return float(value) if isinstance(value, (int, float)) else 0.0

    def opened_at(self, name: str) -> float:
        value = self._db.get(_key(_OPENED, name), 0.0)
        return float(value) if isinstance(value, (int, float)) else 0.0

    # -- reservations --------------------------------------------------------------------------
    def reservations(self) -> dict[str, Reservation | None]:
        """Every reservation; None for a record that cannot be read (to be dropped)."""
        out: dict[str, Reservation | None] = {}
        for name, value in self._scan(_RESERVED):
            if isinstance(value, dict) and _int(value.get("bytes")) is not None:
                out[name] = Reservation(value["bytes"], int(value.get("pid", 0)), bool(value.get("prefetch")))
            else:
                out[name] = None
        return out

    def reserve(self, name: str, reservation: Reservation) -> None:
        self._db.set(_key(_RESERVED, name), {
            "bytes": reservation.bytes, "pid": reservation.pid, "prefetch": reservation.prefetch,
        })

    def release_reservation(self, name: str) -> None:
        self._db.delete(_key(_RESERVED, name))

    # -- history and node-wide counters --------------------------------------------------------
    def note_evicted(self, name: str) -> None:
        """Count an eviction and remember it, so that a later download of `name` counts as a
        re-download."""
        self._db.set(_key(_EVICTED, name), 1)
        self.count("evictions")

    def note_download(self, name: str, received: int) -> bool:
        """Count a committed download; True when the shard had been evicted before (a
        re-download)."""
        again = self._db.pop(_key(_EVICTED, name), None) is not None
        self.count("downloads")
        self.count("bytes_downloaded", received)
        if again:
            self.count("redownloads")
        return again

    def count(self, counter: str, n: int = 1) -> None:
        self._db.incr(_key(_STAT, counter), n, default=0)

    def node_counters(self) -> dict[str, int]:
        """Counters of every process that used this cache directory since it was created."""
        return {c: int(self._db.get(_key(_STAT, c), 0)) for c in NODE_COUNTERS}

    def note_usage(self, total: int) -> None:
        """Record `total` bytes committed plus reserved (caller holds the bookkeeping lock)."""
        if total > self.high_water():
            self._db.set(_key(_STAT, "high_water"), int(total))

    def high_water(self) -> int:
        """The most bytes ever committed plus reserved at once."""
        return int(self._db.get(_key(_STAT, "high_water"), 0))

    def close(self) -> None:
        self._db.close()
