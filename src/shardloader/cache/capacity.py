"""The smallest cache limit a configuration can run with, from its settings alone.

What must fit in the node cache at once, whatever the timing:

* every thread that reads shards holds at most one of them: a reader reads a batch's shards one
  after another, and the readers it keeps open while idle give up their pins when another reader
  needs room (see `pressure.py`). So each reading thread needs room for one shard, either the
  one it reads or the one it downloads next. A rank reads with `max(1, num_workers)` threads
  (worker processes or threads; the training thread itself when `num_workers=0`), and every
  rank on the node shares the cache;
* each rank's prefetcher needs room for one download in flight to make any progress (it backs
  off, and never takes room a waiting reader needs, but with no room at all it is useless).

    minimum = (ranks_per_node * readers_per_rank + prefetching ranks) * largest shard

with "largest shard" counting the companion files cached with it (a tar's offsets sidecar).
Any limit at or above the minimum completes every epoch with the same batches as an unlimited
cache; near the minimum, shards are evicted before they are read again and downloaded again
(counted as `redownloads`). Example: 2 ranks per node, `num_workers=4`, prefetch on, largest
shard 256 MiB: (2*4 + 2) * 256 MiB = 2.5 GiB.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardloader.errors import CacheFullError
from shardloader.format.registry import shard_format
from shardloader.units import format_size


@dataclass(frozen=True)
class CacheNeeds:
    """What one node's configuration needs from its cache."""

    largest: int  # bytes of the largest shard, companion files included
    readers: int  # threads reading shards at once on the node
    downloads: int  # prefetch downloads that must fit besides

    @property
    def minimum(self) -> int:
        return (self.readers + self.downloads) * self.largest

    @property
    def reader_reserve(self) -> int:
        """Bytes prefetching must leave to readers."""
        return self.readers * self.largest


def shard_footprint(info: Any) -> int:
    """Bytes a shard takes in the cache: its file and the companion files stored with it."""
    size = int(info.bytes)
    companion = shard_format(info.format).companion
    offsets = info.extra.get(companion.key) if companion is not None else None
    if isinstance(offsets, dict) and isinstance(offsets.get("bytes"), int):
        size += max(0, offsets["bytes"])
    return size


def largest_footprint(shards: Iterable[Any]) -> int:
    return max((shard_footprint(s) for s in shards), default=0)


def readers_per_rank(num_workers: int) -> int:
    """Threads of one rank that read shards: the workers, or the training thread."""
    return max(1, int(num_workers))


def ranks_per_node(environ: dict[str, str] | None = None) -> int:
    """Ranks sharing this node's cache: $LOCAL_WORLD_SIZE (set by torchrun), else 1."""
    value = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    try:
        return max(1, int(value))
    except ValueError:
        return 1


def cache_needs(largest: int, *, readers_per_rank: int, ranks_per_node: int,
                prefetch_downloads: int) -> CacheNeeds:
    """The needs of a node running `ranks_per_node` ranks over shards of at most `largest`
    bytes (see `largest_footprint`), each rank reading with `readers_per_rank` threads and
    prefetching with `prefetch_downloads` (0 or 1) downloads."""
    return CacheNeeds(
        largest=int(largest),
        readers=ranks_per_node * readers_per_rank,
        downloads=ranks_per_node * prefetch_downloads,
    )


def check_limit(limit: int, needs: CacheNeeds, where: str) -> None:
    """Raise CacheFullError, stating the minimum and what lowers it, when `limit` is below it."""
    if limit >= needs.minimum:
        return
    prefetch = f" + {needs.downloads} prefetch download(s)" if needs.downloads else ""
    raise CacheFullError(
        f"cache {where}: cache_limit {format_size(limit)} ({limit} bytes) is below the minimum "
        f"this configuration needs, {format_size(needs.minimum)} ({needs.minimum} bytes) = "
        f"({needs.readers} shard reader(s) on this node{prefetch}) x the largest shard "
        f"({format_size(needs.largest)}). Raise cache_limit to at least that, or lower "
        f"num_workers (each worker reads one shard at a time), run fewer ranks per node, or "
        f"turn prefetch off"
    )
