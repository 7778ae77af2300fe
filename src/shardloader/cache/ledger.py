"""The cache's ledger: what the node cache holds, reserves and did, in a sqlite database.

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
database itself is safe for many processes (sqlite, write-ahead log). A write the filesystem
refuses (read-only, full) is a CacheDiskError naming the cache, the record and the free space
(see `space.py`).

The database is one table of keys and JSON values, used through the standard library's sqlite3
as documented (the ledger was a diskcache.Cache with its private connection handling patched;
a key-value table is all the ledger needs of it). Fork safety, in two rules sqlite states
(https://sqlite.org/howtocorrupt.html, 2.6), kept here with documented calls only:

* No thread may be inside sqlite when the process forks: a child that inherits one of sqlite's
  internal mutexes locked hangs in its first sqlite call (seen: a loader worker forked while the
  parent's prefetch thread polled the ledger never produced a batch). Every database call holds
  `_GUARD`, and a fork waits for it (`os.register_at_fork`).
* No connection may cross a fork, not even to be closed: a child's copy believes it holds the
  parent's locks, and closing it may checkpoint and delete the write-ahead log the other
  processes use ("database disk image is malformed", seen with 4 workers). So the forking
  process closes its own connections just before it forks (holding the guard), and parent and
  child each open their own on their next call: a child never holds a connection it could
  close by mistake. A fork costs the parent one close and one open (~0.25 ms; forks are worker
  starts), where the ledger held on to leaked references with ctypes before.

A ledger has one connection per process, shared by its threads (every call holds the guard).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardloader.cache.locks import make_private_dir
from shardloader.cache.space import disk_errors

#: The database file in the ledger's directory.
DB_NAME = "ledger.sqlite3"
#: How long a call waits for another process's write (sqlite's busy timeout), seconds.
BUSY_TIMEOUT = 60.0
#: What sqlite's write-ahead log may take on disk (its default checkpointing at 1000 pages: about
#: 4 MiB); `space.DISK_MARGIN` leaves room for it.
LEDGER_WAL_BYTES = 4 << 20

# Held by every database call, and by a fork (see the module's docstring).
_GUARD = threading.RLock()
# The databases with a connection open in this process: closed before a fork.
_OPEN: weakref.WeakSet[_Database] = weakref.WeakSet()


def _before_fork() -> None:
    _GUARD.acquire()
    for db in list(_OPEN):
        db.disconnect()


def _after_fork_in_child() -> None:
    global _GUARD
    _GUARD = threading.RLock()  # the parent's is held by the thread that forked


os.register_at_fork(before=_before_fork, after_in_parent=lambda: _GUARD.release(),
                    after_in_child=_after_fork_in_child)


class _Database:
    """Keys and JSON values in one sqlite table; every call holds the fork guard, and a
    refusal by the filesystem (read-only, full) is a CacheDiskError naming the cache and the
    record. A value that is not valid JSON reads as None."""

    def __init__(self, directory: str, root: str) -> None:
        self._directory, self._root = directory, root
        self._path = os.path.join(directory, DB_NAME)
        self._con: sqlite3.Connection | None = None
        with _GUARD, disk_errors(root, f"opening its ledger in {directory}", path=directory):
            make_private_dir(directory)
            self._connection()

    def _connection(self) -> sqlite3.Connection:
        if self._con is not None:
            return self._con
        con = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT, isolation_level=None,
                              check_same_thread=False)  # threads take turns (the guard)
        try:
            _wal(con)
            con.execute("PRAGMA synchronous = NORMAL")  # durable at checkpoints, as diskcache
            con.execute("CREATE TABLE IF NOT EXISTS ledger "
                        "(key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID")
        except BaseException:
            con.close()
            raise
        self._con = con
        _OPEN.add(self)
        return con

    def disconnect(self) -> None:
        """Close this process's connection (the next call opens another)."""
        con, self._con = self._con, None
        _OPEN.discard(self)
        if con is not None:
            try:
                con.close()
            except sqlite3.Error:
                pass  # nothing written is pending (autocommit): a failed close loses nothing

    def _call(self, doing: str, key: str | None) -> Any:
        record = f" record {key!r}" if key is not None else "s"
        return disk_errors(self._root, f"{doing} the ledger{record} in {self._directory}",
                           path=self._directory)

    def get(self, key: str, default: Any = None) -> Any:
        with _GUARD, self._call("reading", key):
            row = self._connection().execute("SELECT value FROM ledger WHERE key = ?", (key,)).fetchone()
        return default if row is None else _decode(row[0])

    def items(self, prefix: str) -> list[tuple[str, Any]]:
        """Every (key, value) whose key starts with `prefix`, in key order."""
        with _GUARD, self._call("listing", None):
            rows = self._connection().execute(
                "SELECT key, value FROM ledger WHERE substr(key, 1, ?) = ? ORDER BY key",
                (len(prefix), prefix)).fetchall()
        return [(key, _decode(value)) for key, value in rows]

    def set(self, key: str, value: Any) -> None:
        with _GUARD, self._call("writing", key):
            self._connection().execute("INSERT OR REPLACE INTO ledger (key, value) VALUES (?, ?)",
                                       (key, json.dumps(value)))

    def delete(self, key: str) -> None:
        with _GUARD, self._call("deleting", key):
            self._connection().execute("DELETE FROM ledger WHERE key = ?", (key,))

    def pop(self, key: str, default: Any = None) -> Any:
        """Remove `key` and return its value (`default` when absent), in one transaction."""
        with _GUARD, self._call("removing", key), self._transaction() as con:
            row = con.execute("SELECT value FROM ledger WHERE key = ?", (key,)).fetchone()
            con.execute("DELETE FROM ledger WHERE key = ?", (key,))
        return default if row is None else _decode(row[0])

    def incr(self, key: str, n: int = 1) -> int:
        """Add `n` to the integer at `key` (0 when absent or not an integer), in one
        transaction; the new value."""
        with _GUARD, self._call("updating", key), self._transaction() as con:
            row = con.execute("SELECT value FROM ledger WHERE key = ?", (key,)).fetchone()
            value = _decode(row[0]) if row is not None else 0
            value = (value if isinstance(value, int) and not isinstance(value, bool) else 0) + n
            con.execute("INSERT OR REPLACE INTO ledger (key, value) VALUES (?, ?)", (key, json.dumps(value)))
        return value

    def _transaction(self) -> _Transaction:
        return _Transaction(self._connection())

    def close(self) -> None:
        with _GUARD, self._call("closing", None):
            self.disconnect()


class _Transaction:
    """BEGIN IMMEDIATE (the write lock, waiting up to the busy timeout) ... COMMIT, or ROLLBACK
    when the block raised."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self._con = con

    def __enter__(self) -> sqlite3.Connection:
        self._con.execute("BEGIN IMMEDIATE")
        return self._con

    def __exit__(self, kind: Any, *_: Any) -> None:
        self._con.execute("COMMIT" if kind is None else "ROLLBACK")


def _wal(con: sqlite3.Connection) -> None:
    """Put the database in write-ahead-log mode (kept in the file: a no-op once done). Changing
    it needs the database to itself, which sqlite does not wait for: retried up to the busy
    timeout while another process has it open."""
    start = time.monotonic()
    while con.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        try:
            con.execute("PRAGMA journal_mode = WAL").fetchall()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() - start > BUSY_TIMEOUT:
                raise
            time.sleep(0.001)


def _decode(text: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


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
    """Typed access to the cache's ledger database in `directory` (of the cache at `root`,
    named in errors; default: the parent of `directory`)."""

    def __init__(self, directory: str, root: str | None = None) -> None:
        self._db = _Database(directory, root or os.path.dirname(os.path.abspath(directory)))

    def _scan(self, kind: str) -> Iterator[tuple[str, Any]]:
        prefix = kind + "/"
        for key, value in self._db.items(prefix):
            yield key[len(prefix):], value

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
        self._db.incr(_key(_STAT, counter), n)

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
