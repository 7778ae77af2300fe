"""Durable local file operations shared by the writer, the cache and the checkpointer.

A rename is durable only once the directory holding it is flushed: every place that makes a
file appear atomically (temp file, fsync, rename) ends with `fsync_dir` on its directory.
"""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Flush directory `path`, so that renames into it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
