"""Hashing and removing the files of one cached shard.

The store (verification, discarding a damaged file), eviction, reconcile and maintenance all do
these few things to a shard's files; they live here so that none of those modules imports
another for them.
"""

from __future__ import annotations

import contextlib
import os

from shardloader.cache.layout import COMPANION_SUFFIXES, CacheLayout
from shardloader.io.checksum import checksum_fd, parse_checksum


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


def remove_temps(layout: CacheLayout, name: str) -> None:
    """Remove leftover temp files of `name` (caller holds its download lock)."""
    for temp in list(layout.temps_of(name)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
