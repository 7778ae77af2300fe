"""`ShardSource`: everything a dataset and a Loader may ask of the place shard files come from.

One declared protocol, with a null default for every member a source may lack (a `typing.
Protocol` whose methods have real bodies): `LocalSource` and `RemoteSource` subclass it
explicitly and inherit the defaults, so callers never probe a source with `getattr` and never
ask which class it is. What differs between sources that callers must know is declared as
class attributes (`counts_reads`, `reads_in_place`, `reads_by_range`).

The cache counters a source reports are named here once (`SOURCE_COUNTERS`; the per-batch ones
`BATCH_COUNTERS`), and `counter_delta` is the one way to take what a batch added to them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from shardloader.format.index import ShardInfo
from shardloader.io.identity import FileIdentity

#: Cache counters every batch reports (telemetry `BatchRecord` fields of the same names).
BATCH_COUNTERS = ("cache_hits", "cache_misses", "bytes_downloaded")
#: Counters every source's `counters()` holds (zeros for a source that counts nothing).
SOURCE_COUNTERS = (*BATCH_COUNTERS, "download_seconds", "peer_download_wait_seconds")


#: Counters the job's account takes per batch beside `BATCH_COUNTERS` (a source may lack any:
#: zero), into `BatchTimings.extra`.
JOB_COUNTERS = ("bytes_from_cache", "range_bytes", "range_requests", "downloads", "redownloads",
                "bytes_redownloaded")


def job_counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What the `JOB_COUNTERS` gained from `before` to `after`; only those that moved."""
    moved = {}
    for name in JOB_COUNTERS:
        gained = after.get(name, 0) - before.get(name, 0)
        if gained:
            moved[name] = gained
    return moved


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> tuple[int, int, int]:
    """What the `BATCH_COUNTERS` gained from `before` to `after` (two `counters()` readings),
    in that order: (cache_hits, cache_misses, bytes_downloaded)."""
    hits, misses, downloaded = (int(after.get(name, 0) - before.get(name, 0)) for name in BATCH_COUNTERS)
    return hits, misses, downloaded


class ShardSource(Protocol):
    """Gives local, verified paths for a dataset's shards; and, for a remote dataset under a
    Loader, rows by byte range, prefetch and cache counters. Every member but `local_path`
    has a null default: what a local directory needs (nothing)."""

    root: str

    #: Whether `counters()` counts anything. False: they are always zeros, so a reader takes
    #: no deltas of them.
    counts_reads: ClassVar[bool] = False
    #: Whether shard files are read where they lie (a local directory): reading a sample
    #: downloads nothing.
    reads_in_place: ClassVar[bool] = False
    #: Whether `read_by_range` and `prime_ranges` may do anything. False: they return {} and
    #: 0, so a reader need not ask (nor time the asking).
    reads_by_range: ClassVar[bool] = False

    # -- what a dataset asks -------------------------------------------------------------------
    @abstractmethod
    def local_path(self, info: ShardInfo) -> str:
        """A local path to the whole, verified file of shard `info` (fetching it if needed),
        pinned until `release(info)`."""

    def release(self, info: ShardInfo) -> None:
        """The caller no longer reads shard `info` (a cached shard may be evicted again)."""
        return None

    def verified_identity(self, info: ShardInfo) -> FileIdentity | None:
        """The identity of the file `local_path` last verified for `info`, or None. A reader
        opened on any other file is reopened (see `Dataset`); a source that answers None is
        trusted to keep its files unchanged."""
        return None

    def read_by_range(self, wanted: Sequence[tuple[ShardInfo, Any]]) -> dict[int, list[dict[str, Any]]]:
        """Records of the rows of each (shard, rows) in `wanted` that this source reads by
        byte range now, by position in `wanted`; the others are left to `local_path`."""
        return {}

    def prime_ranges(self, wanted: Sequence[tuple[ShardInfo, Any]], *, ahead: bool = False) -> int:
        """Fetch now, and keep in this process, what reading the rows of `wanted` by range
        needs; returns the spans kept. `ahead`: before the Loader iterates, which primes again
        (a failed fetch is left to it, never taken for "read that shard whole")."""
        return 0

    def url_of(self, info: ShardInfo) -> str:
        """Where shard `info` comes from, for messages."""
        return info.path

    def add_idle_releaser(self, releaser: Callable[[], int]) -> None:
        """Register this process's reader pool: `releaser()` closes its idle readers when the
        source needs their room."""
        return None

    def check_capacity(self, index: Any, *, num_workers: int) -> Any:
        """Refuse, before anything is read, a configuration this source cannot serve (a cache
        too small for reading `index` with `num_workers` per rank)."""
        return None

    # -- what a Loader's epoch asks (the order: see shardloader.loader.prefetch_policy) --------
    def expect_prefetch(self) -> None:
        """A Loader that prefetches whole shards is about to start its workers."""
        return None

    def defers_prefetch(self, index: Any) -> bool:
        """Whether the Loader should start prefetch only once the first batch is out."""
        return False

    def warm_ranges(self, shard_infos: Iterable[ShardInfo], *, first_batch: bool = False) -> Any:
        """Fetch in the background what reading `shard_infos` by range needs (their range
        sidecars), for this process and the workers; returns at once. `first_batch`: they are
        the next first batch's (a Loader asks when it is made or restored), so they may reach
        the node only once that batch is out."""
        return None

    def start_prefetch(self, shard_infos: Iterable[ShardInfo]) -> Any:
        """Start fetching `shard_infos` (in order of first need) in the background; returns a
        handle with `stop()` (None: nothing was started). Never blocks the caller. By default
        there is nothing to prefetch: local shards are read in place."""
        return NoPrefetch()

    def node_counters(self) -> dict[str, int]:
        """Counters of the node's cache shared by every process (`high_water`: the most bytes
        it held at once, ...); {} for a source without a cache."""
        return {}

    def counters(self) -> dict[str, float]:
        """This process's counters: at least `SOURCE_COUNTERS` (cache_hits, cache_misses,
        bytes_downloaded, download_seconds, peer_download_wait_seconds); zeros for a local
        source."""
        return dict.fromkeys(SOURCE_COUNTERS, 0)


class NoPrefetch:
    """The handle of a source that has nothing to prefetch (local data). Here, not in
    `shardloader.cache.prefetch`: a local dataset's Loader then never imports the node cache
    (its store, ledger and sqlite: 1.7 MiB of the training process's RSS)."""

    scheduled: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    def stop(self, timeout: float = 0.0) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        return True

    @property
    def running(self) -> bool:
        return False

    def __enter__(self) -> NoPrefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
