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
missing (after an eviction) the count starts from zero; a read that found the shard missing just
before may still count after that: at most that one read's bytes are left over to the next time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os

from shardloader.cache.layout import CacheLayout
from shardloader.cache.locks import close_fd, open_fd

log = logging.getLogger(__name__)

_WIDTH = 8


def spend(layout: CacheLayout, name: str, cost: int, limit: float) -> bool:
    """Count `cost` more bytes read by range of shard `name` on this node and return True, or
    count nothing and return False when the node's count would pass `limit` (then the reader
    waits for the whole shard). False also when the count cannot be kept (a disk error): the
    whole-shard path reports what is wrong with the cache."""
    return spend_first(layout, name, [cost], limit) is not None


def spend_first(layout: CacheLayout, name: str, costs: list[int], limit: float) -> int | None:
    """The position of the first of `costs` that the node's count of shard `name` can take
    within `limit`, counted; None (nothing counted) when none fits or the count cannot be kept.
    Read and chosen under the count's lock, so that what other processes spent meanwhile is
    seen."""
    try:
        fd = open_fd(layout.spent_of(name), os.O_RDWR | os.O_CREAT)
    except OSError:
        log.debug("cache %s: cannot count bytes read by range of %s", layout.root, name, exc_info=True)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.pread(fd, _WIDTH, 0)
        spent = int.from_bytes(raw, "little") if len(raw) == _WIDTH else 0
        for position, cost in enumerate(costs):
            if spent + cost <= limit:
                os.pwrite(fd, (spent + cost).to_bytes(_WIDTH, "little"), 0)
                return position
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
