"""The bytes of a shard that the node has read by range while the shard is not whole: one
count per shard for every process on the node.

Reads by range (`shardloader.source.ranged`) fetch at most a fraction of a shard (the range
budget) and then wait for the whole shard, so that a shard costs the node at most that fraction
on top of its one download. Counted per process, every process (and every worker process) on a
node had a budget of its own: three processes reading one remote dataset through one cache were
sent up to 2.4x a shard's bytes (1.39-1.86x in tests/test_cache_ranged_shared.py at a 1.5 MB/s
link), when the node needs the shard once. Counted here, for the node, a shard costs at most
1 + budget.

The count is the file `locks/<name>.spent` (8 bytes, little-endian), read and changed under its
own flock: a killed process leaves no lock behind, and what it spent stays counted. A download
removes it when its shard is committed whole (`forget`), so that the next time the shard is
missing (after an eviction) the count starts from zero. A read that found the shard missing just
before the commit asks to spend after it: under the count's lock it finds the shard whole and
spends nothing (it reads the cache instead). Without that check, such a read counted from zero
again, and its bytes went past the bound (1.253x in CI with three processes).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterable
from typing import TypeVar

from shardloader.cache.layout import CacheLayout
from shardloader.cache.locks import close_fd, open_fd

log = logging.getLogger(__name__)

_WIDTH = 8
T = TypeVar("T")


def spend_first(layout: CacheLayout, name: str, options: Iterable[tuple[T, int]],
                limit: float) -> T | None:
    """The first of `options` (each: what to do, the bytes it reads by range of shard `name`)
    whose bytes the node's count can take within `limit`, counted; None (nothing counted) when
    none fits (then the reader waits for the whole shard), the shard is whole in the cache
    already (then it reads the cache), or the count cannot be kept (a disk error: the
    whole-shard path reports what is wrong with the cache). Read and chosen under
    the count's lock, so that what other processes spent meanwhile is seen; `options` are
    taken in order, as far as the first that fits (a lazy iterable computes no more)."""
    try:
        fd = open_fd(layout.spent_of(name), os.O_RDWR | os.O_CREAT)
    except OSError:
        log.debug("cache %s: cannot count bytes read by range of %s", layout.root, name, exc_info=True)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.exists(layout.path_of(name)):
            return None  # committed (then `forget`) since the reader looked: no read by range now
        raw = os.pread(fd, _WIDTH, 0)
        spent = int.from_bytes(raw, "little") if len(raw) == _WIDTH else 0
        for option, cost in options:
            if spent + cost <= limit:
                os.pwrite(fd, (spent + cost).to_bytes(_WIDTH, "little"), 0)
                return option
        return None
    except OSError:
        log.debug("cache %s: cannot count bytes read by range of %s", layout.root, name, exc_info=True)
        return None
    finally:
        close_fd(fd)


def forget(layout: CacheLayout, name: str) -> None:
    """Shard `name` is whole in the cache: drop its count (see the module's docstring)."""
    with contextlib.suppress(OSError):
        os.unlink(layout.spent_of(name))
