"""Kernel-held locks of the node cache, and keeping them out of forked children.

Every lock the cache takes is a `flock` on an open file description: the kernel drops it when
the last descriptor closes, so a killed process leaves no lock behind and nothing must be
cleaned up (design invariant I6). Three kinds exist:

* a shard's download lock (exclusive on `locks/<name>.lock`): one downloader per shard;
* the bookkeeping lock (exclusive on `locks/bookkeeping.lock`): guards sizes, reservations and
  eviction;
* a pin (shared on the cached shard file itself): a reader reads it; eviction skips it.

A forked child inherits descriptors, and with them their locks: a worker forked while the
prefetcher holds a download lock would keep it for its whole life. Every descriptor that may
carry a lock is registered here, and a child closes its copies at once (the parent keeps its own,
so the parent's locks are unaffected).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator

DIR_MODE = 0o700
FILE_MODE = 0o600

_LOCK_FDS: set[int] = set()
_LOCK_FDS_GUARD = threading.RLock()  # re-entrant: a finalizer may run while it is held
_AFTER_FORK: list[Callable[[], None]] = []


def open_fd(path: str, flags: int, mode: int = FILE_MODE) -> int:
    """`os.open`, with the descriptor registered to be closed in forked children.

    Opening and registering happen under the guard that a fork takes (see `_before_fork`):
    a child forked between the two would keep an unregistered copy, and with it any lock the
    parent later takes on that file description, for its whole life."""
    with _LOCK_FDS_GUARD:
        fd = os.open(path, flags | os.O_CLOEXEC, mode)
        _LOCK_FDS.add(fd)
    return fd


def close_fd(fd: int) -> None:
    """Close a descriptor from `open_fd` (closing the last one drops its lock). Unregistering
    and closing happen under the fork guard, for the same reason as in `open_fd`."""
    with _LOCK_FDS_GUARD:
        _LOCK_FDS.discard(fd)
        os.close(fd)


def after_fork_in_child(callback: Callable[[], None]) -> None:
    """Run `callback` in every forked child, after the inherited lock descriptors are closed."""
    _AFTER_FORK.append(callback)


def _close_inherited() -> None:
    global _LOCK_FDS_GUARD
    _LOCK_FDS_GUARD = threading.RLock()  # another thread may have held it at the fork
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    for callback in list(_AFTER_FORK):
        callback()


def _before_fork() -> None:
    _LOCK_FDS_GUARD.acquire()  # no descriptor is half opened or half closed while we fork


def _after_fork_in_parent() -> None:
    _LOCK_FDS_GUARD.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_close_inherited)


@contextlib.contextmanager
def exclusive(path: str, *, on_wait: Callable[[float], None] | None = None) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if needed) for the block; blocks until free.

    `on_wait(seconds)` is called when the lock was busy and had to be waited for."""
    fd = open_fd(path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            start = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            if on_wait is not None:
                on_wait(time.monotonic() - start)
        yield
    finally:
        close_fd(fd)


def held_elsewhere(path: str) -> bool:
    """True while some open file description holds an exclusive flock on `path`."""
    try:
        fd = open_fd(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        close_fd(fd)


def try_exclusive(path: str) -> int | None:
    """A descriptor holding an exclusive flock on `path` taken without waiting, or None when
    the file is gone or locked (shared or exclusive) by anyone."""
    try:
        fd = open_fd(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        close_fd(fd)
        return None


def pin_file(path: str) -> int | None:
    """A descriptor holding a shared flock on the file now at `path`, or None if there is none
    (absent, or evicted/replaced between open and lock)."""
    try:
        fd = open_fd(path, os.O_RDONLY)
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
            close_fd(fd)
            return None
        return fd
    except BaseException:
        with contextlib.suppress(OSError):
            close_fd(fd)
        raise


def make_private_dir(path: str) -> None:
    """Create `path` (and parents) owner-only; an existing non-directory is an error."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "cache path exists and is not a directory", path) from None
    except FileNotFoundError:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
