"""Durable local file operations shared by the writer, the cache and the checkpointer.

A rename is durable only once the directory holding it is flushed: every place that makes a
file appear atomically (temp file, fsync, rename) ends with `fsync_dir` on its directory.
"""

from __future__ import annotations

import errno
import os


def fsync_dir(path: str) -> None:
    """Flush directory `path`, so that renames into it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_at(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of `data` at `offset` of `fd`. `os.pwrite` may write only part of it (a
    filesystem that fills up mid-write does): the rest is written again, and a full disk then
    raises its OSError (ENOSPC) instead of leaving a hole that looks like a corrupt download."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[written:], offset + written
