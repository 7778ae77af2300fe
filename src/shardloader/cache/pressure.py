"""Asking every process on the node to give up idle pins when a reader needs room.

A process keeps recently used shard readers open (up to `max_open_shards`), and each open
reader pins its shard. That is what makes reading fast, and harmless while the cache has room.
When a reader cannot make room, idle readers must close: in its own process at once (the store
calls the releasers the reader pool registered), in other processes through this signal.

The signal is the modification time of one file, `locks/pressure`: a waiting reader sets it to
now on every poll; a watcher thread in each process that has releasers looks at it every
`POLL_SECONDS` and releases its idle pins when it changed. A recent mtime also tells
prefetchers to back off, so that room freed for a reader goes to that reader. Stat-ing a file
costs about a microsecond; nothing here holds a lock, and a process that dies leaves only a
timestamp that ages out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)
POLL_SECONDS = 0.02
RECENT_SECONDS = 0.5  # a reader waited this recently: prefetch backs off


class PressureSignal:
    """The node-wide "a reader is waiting for room" flag of one cache directory."""

    def __init__(self, path: str) -> None:
        self.path = path

    def raise_(self) -> None:
        now = time.time_ns()
        try:
            os.utime(self.path, ns=(now, now))
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
                os.close(fd)
                os.utime(self.path, ns=(now, now))

    def stamp(self) -> int:
        """The signal's current value (0 when never raised)."""
        try:
            return os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return 0

    def recent(self, seconds: float = RECENT_SECONDS) -> bool:
        """True when a reader raised the signal in the last `seconds`."""
        return time.time_ns() - self.stamp() < seconds * 1e9


class PressureWatcher:
    """A daemon thread that calls `release()` whenever the signal changes. It stops when the
    owner (held weakly) is gone or `stop()` is called."""

    def __init__(self, signal: PressureSignal, owner: object, release: Callable[[object], int]) -> None:
        self._signal = signal
        self._owner = weakref.ref(owner)
        self._release = release
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardloader-cache-pressure", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = self._signal.stamp()
        while not self._stop.wait(POLL_SECONDS):
            owner = self._owner()
            if owner is None:  # the cache handle is gone: nothing to release any more
                return
            stamp = self._signal.stamp()
            if stamp == seen:
                del owner
                continue
            seen = stamp
            try:
                self._release(owner)
            except Exception:  # noqa: BLE001 - a watcher must never die of a reader's error
                log.warning("releasing idle shard readers failed", exc_info=True)
            del owner

    def stop(self) -> None:
        self._stop.set()
