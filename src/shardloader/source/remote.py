"""`RemoteSource`: shards of a dataset at any fsspec URL, read through the node's shard cache.

`Dataset("s3://bucket/prefix", cache_dir=..., cache_limit="200GB", storage_options=...)` builds
one. Each process (the training process and every worker it starts) opens the same cache
directory; downloads go through `shardloader.cache.store.ShardCache` (one downloader per shard,
verified, atomic, bounded) and `shardloader.io.transfer.download` (ranged reads with retries).

The object pickles as its configuration only, so the Dataset travels into worker processes
cheaply; each process opens its own filesystem client and cache handle on first use and keeps
its own counters (`counters()`).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from shardloader.cache.capacity import (
    CacheNeeds,
    cache_needs,
    check_limit,
    largest_footprint,
    ranks_per_node,
    readers_per_rank,
)
from shardloader.cache.download import Companion, Fetch
from shardloader.cache.layout import sidecar_name
from shardloader.cache.prefetch import Prefetcher
from shardloader.cache.sidecars import SidecarWant, cached_sidecar
from shardloader.cache.space import check_writable, make_cache_root
from shardloader.cache.store import COUNTER_NAMES, Releaser, ShardCache
from shardloader.errors import ShardloaderError, UnsafePathError
from shardloader.format.index import ShardInfo
from shardloader.format.ranges import RANGES_KEY
from shardloader.format.registry import shard_format
from shardloader.io.checksum import parse_checksum
from shardloader.io.clients import filesystem
from shardloader.io.paths import join_url, safe_relative_path
from shardloader.io.retry import RetryPolicy
from shardloader.io.transfer import FetchStats, download
from shardloader.source.protocol import NoPrefetch, ShardSource
from shardloader.source.ranged import RangeReads
from shardloader.units import parse_size

log = logging.getLogger(__name__)

#: Held while a `warm_ranges` thread consumes its (lazy) iterable of shards: a Loader's works
#: them out from its order under its plan's lock, which a child forked meanwhile would inherit
#: taken, and deadlock on (seen: a worker of a restored Loader never produced a batch). A fork
#: waits for it, as it does for the ledger's sqlite calls (`shardloader.cache.ledger`).
_PLANNING = threading.Lock()


def _planning_in_child() -> None:
    global _PLANNING
    _PLANNING = threading.Lock()


os.register_at_fork(before=lambda: _PLANNING.acquire(), after_in_parent=lambda: _PLANNING.release(),
                    after_in_child=_planning_in_child)

CACHE_DIR_ENV = "SHARDLOADER_CACHE_DIR"
CACHE_LIMIT_ENV = "SHARDLOADER_CACHE_LIMIT"


def _size(value: int | str, what: str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def default_cache_dir() -> str:
    """$SHARDLOADER_CACHE_DIR, else $XDG_CACHE_HOME/shardloader, else ~/.cache/shardloader."""
    if os.environ.get(CACHE_DIR_ENV):
        return os.environ[CACHE_DIR_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardloader")


def default_cache_limit(cache_dir: str) -> int:
    """$SHARDLOADER_CACHE_LIMIT, else 80% of the space free on the cache's filesystem now."""
    if os.environ.get(CACHE_LIMIT_ENV):
        return _size(os.environ[CACHE_LIMIT_ENV], CACHE_LIMIT_ENV)
    return max(1, int(shutil.disk_usage(cache_dir).free * 0.8))


class RemoteSource(ShardSource):
    """Verified local paths for the shards of a remote dataset, through the node cache.

    `cache_limit` is a hard bound in bytes (or a size string) on the shards kept in
    `cache_dir`; it must be at least the minimum `check_capacity` states (one largest shard
    per reading thread on the node, plus one prefetch download per rank). `retry` bounds retries per shard. `chunk_size` and `parallel_ranges` set how a
    shard is read (ranges of that size, that many at once). `prefetch=False` turns background
    prefetch off (readers then fetch on demand). The prefetch knobs bound the background window: `prefetch_concurrency` downloads at once, at most `prefetch_shards`
    shards and `prefetch_bytes` bytes (default: half the cache limit) scheduled but not yet
    opened by a reader; prefetch never takes the room readers need. `full_timeout` is how long
    a reader waits for other processes to release shards before `CacheFullError`.
    `range_reads` lets readers under a Loader read rows of shards not yet cached by byte range
    (`range_gap`: spans this close share a request; `range_budget`: at most this fraction of a
    shard per node, all processes together, then it is read whole); see `shardloader.source.ranged`.
    When a Loader's prefetch starts: `shardloader.loader.prefetch_policy`.
    """

    counts_reads = True
    reads_by_range = True

    def __init__(
        self,
        url: str,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        chunk_size: int | str = "8MiB",
        parallel_ranges: int = 4,
        prefetch: bool = True,
        prefetch_concurrency: int = 8,
        prefetch_shards: int = 16,
        prefetch_bytes: int | str | None = None,
        full_timeout: float = 30.0,
        range_reads: bool = True,
        range_gap: int | str = "1MiB",
        range_budget: float = 0.25,
    ) -> None:
        self.root = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.cache_dir = os.path.abspath(os.fspath(cache_dir or default_cache_dir()))
        make_cache_root(self.cache_dir)  # CacheDiskError naming it when it cannot be made
        self.cache_limit = (
            _size(cache_limit, "cache_limit") if cache_limit is not None
            else default_cache_limit(self.cache_dir)
        )
        if self.cache_limit <= 0:
            raise ValueError(f"cache_limit must be positive, got {cache_limit!r}")
        self.retry = retry or RetryPolicy()
        self.chunk_size = _size(chunk_size, "chunk_size")
        if self.chunk_size <= 0 or parallel_ranges < 1:
            raise ValueError("chunk_size must be positive and parallel_ranges at least 1")
        self.parallel_ranges = parallel_ranges
        self.prefetch = prefetch
        self.prefetch_concurrency = prefetch_concurrency
        self.prefetch_shards = prefetch_shards
        self.prefetch_bytes = (
            _size(prefetch_bytes, "prefetch_bytes") if prefetch_bytes is not None
            else self.cache_limit // 2
        )
        self.full_timeout = full_timeout
        self.range_reads = range_reads
        self.range_gap = _size(range_gap, "range_gap")
        if not 0 <= range_budget:
            raise ValueError(f"range_budget must be >= 0, got {range_budget}")
        self.range_budget = float(range_budget)
        self.prefetch_expected = False  # set by a Loader that prefetches whole shards
        # When this run began reading: shards prefetched after it and unread are not cache
        # savings (`ShardCache._saved_download`); travels to the workers with the config.
        self.fresh_after = time.time()
        self.needs: CacheNeeds | None = None  # set by check_capacity
        self._reset_process_state()

    _CONFIG = (
        "root", "storage_options", "cache_dir", "cache_limit", "retry", "chunk_size",
        "parallel_ranges", "prefetch", "prefetch_concurrency", "prefetch_shards", "prefetch_bytes",
        "full_timeout", "range_reads", "range_gap", "range_budget", "prefetch_expected", "needs",
        "fresh_after",
    )

    def _reset_process_state(self) -> None:
        # Reads by range of a parent (primed for the first batch, sidecars decoded) carry over
        # into a forked worker; everything else here is per process.
        inherited: RangeReads | None = getattr(self, "_ranged", None)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._store_obj: ShardCache | None = None
        self._fs: Any = None
        self._base = ""
        self._rng = random.Random()
        self._releasers: list[Releaser] = []
        self._largest: tuple[Any, int] | None = None  # (index fingerprint, largest footprint)
        self._ranged: RangeReads | None = inherited.after_fork() if inherited is not None else None
        self._warming: list[threading.Thread] = []  # this process's warm_ranges threads

    def __getstate__(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self._CONFIG}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key in self._CONFIG:
            setattr(self, key, state[key])
        self._reset_process_state()

    # -- per-process handles -------------------------------------------------------------------
    @property
    def store(self) -> ShardCache:
        """This process's handle on the node cache."""
        if self._pid != os.getpid():
            self._reset_process_state()
        with self._lock:
            if self._store_obj is None:
                store = ShardCache(self.cache_dir, self.cache_limit, full_timeout=self.full_timeout,
                                   fresh_after=self.fresh_after)
                if self.needs is not None:
                    store.reader_reserve = self.needs.reader_reserve
                for releaser in self._releasers:
                    store.add_releaser(releaser)
                self._store_obj = store
            return self._store_obj

    def _filesystem(self) -> tuple[Any, str]:
        if self._pid != os.getpid():
            self._reset_process_state()
        with self._lock:
            if self._fs is None:  # this process's client (see shardloader.io.clients on forks)
                self._fs, self._base = filesystem(self.root, self.storage_options)
            return self._fs, self._base

    def url_of(self, info: ShardInfo) -> str:
        return join_url(self.root, info.path)

    def plan(self, info: ShardInfo) -> tuple[Fetch, tuple[Companion, ...]]:
        """How to download `info`: the shard's fetch callback, and its companion files (a tar
        shard's offsets sidecar, when the index describes one)."""
        return self._fetch_callback(info.path, info.bytes, info.checksum), self._companions(info)

    def _fetch_callback(self, relative: str, size: int, checksum: str) -> Fetch:
        fs, base = self._filesystem()
        path = join_url(base, relative) if base else relative
        url = join_url(self.root, relative)

        def fetch(fd: int, cancel: threading.Event | None) -> FetchStats:
            return download(
                fs, path, url, fd, size=size, checksum=checksum, policy=self.retry,
                chunk_size=self.chunk_size, parallel=self.parallel_ranges, cancel=cancel,
                rng=self._rng,
            )

        return fetch

    def _companions(self, info: ShardInfo) -> tuple[Companion, ...]:
        companion = shard_format(info.format).companion
        if companion is None:
            return ()
        entry = info.extra.get(companion.key)
        if not isinstance(entry, dict):
            return ()
        relative, size, checksum = entry.get("path"), entry.get("bytes"), entry.get("checksum")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return ()
        try:
            relative = safe_relative_path(relative, what=f"{info.path}: offsets sidecar")
            parse_checksum(str(checksum))
        except (UnsafePathError, ValueError) as e:
            log.warning("%s: not caching the offsets sidecar: %s", info.path, e)
            return ()
        fetch = self._fetch_callback(relative, size, str(checksum))
        try:  # a read by range may have put it on the node already: the server is asked once
            want = SidecarWant(sidecar_name(str(checksum), companion.key), size, str(checksum),
                               join_url(self.root, relative))
        except ValueError:
            return (Companion(companion.suffix, size, fetch),)

        def from_node(fd: int, cancel: threading.Event | None) -> FetchStats:
            data = cached_sidecar(self.store, want)
            if data is None:
                return fetch(fd, cancel)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            return FetchStats()

        return (Companion(companion.suffix, size, from_node),)

    # -- the ShardSource contract --------------------------------------------------------------
    def local_path(self, info: ShardInfo) -> str:
        """A local path to the whole, verified file of `info`, pinned until `release(info)`.

        Downloads it, or waits for the process already downloading it. Raises FetchError
        (URL and cause) or CacheFullError.
        """
        fetch, companions = self.plan(info)
        return self.store.open(info, fetch, companions)

    def read_by_range(self, wanted: Sequence[tuple[ShardInfo, Any]]) -> dict[int, list[dict[str, Any]]]:
        """Records of the rows of each (shard, rows) in `wanted` whose shard the node cache does
        not hold yet, read by byte range (see `shardloader.source.ranged`), by position in
        `wanted`; the others (cached shards, shards without range sidecars, reads over the
        budget) are left to `local_path`. Only under a Loader that prefetches (see
        `expect_prefetch`): the prefetcher is what puts whole shards into the cache behind the
        range reads; reads without one (a Dataset used alone) fetch whole shards, as always."""
        if not (self.range_reads and self.prefetch and self.prefetch_expected) or not wanted:
            return {}
        store = self.store
        todo: list[tuple[int, tuple[ShardInfo, Any]]] = []
        for pos, (info, rows) in enumerate(wanted):
            try:
                if os.path.exists(store.path_for(info)):
                    continue  # whole in the cache: read it there
            except ShardloaderError:
                continue  # a bad index entry: the whole-shard path names it
            todo.append((pos, (info, rows)))
        if not todo:
            return {}
        got = self._range_reads().read([item for _, item in todo])
        return {todo[i][0]: records for i, records in got.items()}

    def prime_ranges(self, wanted: Sequence[tuple[ShardInfo, Any]], *, ahead: bool = False) -> int:
        """Fetch now, and keep in this process, the spans that reading the rows of `wanted`
        ((shard, rows): a Loader's first batch) by range needs, for shards the node cache does
        not hold whole; worker processes forked afterwards inherit them and read those rows
        without a request. Only where `read_by_range` would read by range once the Loader
        iterates (it may call this before: from `Loader()`, in the background). Returns the
        spans kept; never raises (see `RangeReads.prime`). The sidecars it fetches go onto the
        node once the first batch is out (`start_prefetch`), not on that batch's path.
        `ahead`: called from `Loader()`; its sidecars are fetched as `warm_ranges` fetches
        them (a failure is left to the priming at `iter()`, which fetches them again)."""
        if not (self.range_reads and self.prefetch) or not wanted:
            return 0
        store = self.store
        todo = []
        for info, rows in wanted:
            try:
                if RANGES_KEY not in info.extra or os.path.exists(store.path_for(info)):
                    continue
            except ShardloaderError:
                continue
            todo.append((info, rows))
        return self._range_reads().prime(todo, hold=True, background=ahead) if todo else 0

    def expect_prefetch(self) -> None:
        """Called by a Loader before it starts its workers: its prefetcher will download whole
        shards in order of need, so readers may read rows of shards not yet cached by range
        meanwhile (the setting travels to worker processes with the dataset)."""
        self.prefetch_expected = True

    def warm_ranges(self, shard_infos: Iterable[ShardInfo], *,
                    first_batch: bool = False) -> threading.Thread | None:
        """Fetch the range sidecars of `shard_infos` in a background thread, into this process
        (its reads by range, and workers forked later, then need no sidecar round) and onto the
        node (for workers already running); returns at once. A Loader calls it when it is made
        and when a state is loaded, for the next first batch's shards (`first_batch`: the cold
        start's first round of requests then overlaps whatever the script does before it
        iterates; they go onto the node once that batch is out, as `prime_ranges`'s), and while
        its workers start, for the next batches'. Only the sidecars: the spans are
        `prime_ranges`'s, which waits for these instead of fetching them again. Shards whole on
        the node when the thread runs are left out; `shard_infos` is consumed in the thread. A
        fetch that fails here is fetched again by the read that needs it, which raises what is
        not transient (see `RangeReads.warm`)."""
        if not (self.range_reads and self.prefetch):
            return None
        reads = self._range_reads()

        def warm() -> None:
            try:  # `shard_infos` is consumed here, in the thread (it may be worked out lazily)
                with _PLANNING:
                    wanted = [info for info in shard_infos if RANGES_KEY in info.extra]
            except Exception:  # noqa: BLE001 - an optimisation: the first batch's priming asks again
                log.warning("working out which range sidecars to fetch ahead failed", exc_info=True)
                return
            infos = [info for info in wanted if not self._whole_on_node(info)]
            if infos:
                reads.warm(infos, first_batch=first_batch)

        thread = threading.Thread(target=warm, name="shardloader-ranges", daemon=True)
        thread.start()
        with self._lock:
            self._warming = [t for t in self._warming if t.is_alive()] + [thread]
        return thread

    def wait_warm(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds in all for this process's `warm_ranges` threads (their
        sidecars fetched, decoded and committed to the node cache); whether they all ended."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._warming) if self._pid == os.getpid() else []
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def _whole_on_node(self, info: ShardInfo) -> bool:
        try:
            return os.path.exists(self.store.path_for(info))
        except ShardloaderError:
            return True  # a bad index entry: the whole-shard path names it

    def defers_prefetch(self, index: Any) -> bool:
        """Whether the Loader should start prefetch only after the first batch: when every
        shard can be read by range, whole-shard downloads would only compete with the reads
        the first batch waits for. Not when a Parquet shard has so few row groups that one of
        them passes the range budget: the first batch would then wait for whole shards, and
        prefetch fetches them in parallel."""
        def by_range(info: ShardInfo) -> bool:
            if RANGES_KEY not in info.extra:
                return False
            if not shard_format(info.format).reads_whole_groups:
                return True
            groups = info.extra.get("row_groups")
            return isinstance(groups, int) and groups * self.range_budget >= 2

        return bool(self.range_reads and self.prefetch and index.shards
                    and all(by_range(info) for info in index.shards))

    def _range_reads(self) -> RangeReads:
        if self._pid != os.getpid():
            self._reset_process_state()
        with self._lock:
            if self._ranged is None:
                self._ranged = RangeReads(self._filesystem, self.root, cache=lambda: self.store,
                                          policy=self.retry, gap=self.range_gap,
                                          budget=self.range_budget)
            return self._ranged

    def release(self, info: ShardInfo) -> None:
        """The caller stopped reading `info`: unpin it so that it may be evicted."""
        if self._store_obj is not None and self._pid == os.getpid():
            self._store_obj.release(info)

    def add_idle_releaser(self, releaser: Releaser) -> None:
        """Register this process's reader pool: `releaser()` closes its idle readers (giving up
        their pins) when a reader on the node needs room."""
        store = self.store  # resets per-process state first after a fork
        self._releasers.append(releaser)
        store.add_releaser(releaser)

    def check_capacity(self, index: Any, *, num_workers: int) -> CacheNeeds:
        """Refuse (CacheFullError, stating the minimum and what lowers it) a cache limit under
        what reading `index` with `num_workers` per rank needs on this node (see `capacity.py`);
        remember the needs so that prefetch leaves readers their room. Called by the Loader
        when iteration starts, before anything is read."""
        key = getattr(index, "fingerprint", None)
        if self._largest is None or self._largest[0] != key or key is None:
            self._largest = (key, largest_footprint(index.shards))  # O(shards): once per index
        needs = cache_needs(self._largest[1], readers_per_rank=readers_per_rank(num_workers),
                            ranks_per_node=ranks_per_node(), prefetch_downloads=int(self.prefetch))
        check_limit(self.cache_limit, needs, self.cache_dir)
        check_writable(self.cache_dir)  # a read-only cache: one clear error before any worker
        self.needs = needs
        if self._store_obj is not None and self._pid == os.getpid():
            self._store_obj.reader_reserve = needs.reader_reserve
        return needs

    def start_prefetch(self, shard_infos: Iterable[ShardInfo]) -> Prefetcher | NoPrefetch:
        """Start downloading `shard_infos` (order of first need) in background threads, and
        commit the range sidecars fetched for the first batch (a Loader calls this once it is
        out, or right after its workers start when it does not defer prefetch).

        Returns at once; call `.stop()` on the handle to end it.
        """
        if not self.prefetch:
            return NoPrefetch()
        if self._ranged is not None and self._pid == os.getpid():
            self._ranged.release_held()  # before the prefetcher: a tar's companion is one of them
        window = self.prefetch_bytes
        if self.needs is not None:  # this rank's share of what readers leave free
            ranks = max(1, self.needs.downloads)
            share = (self.cache_limit - self.needs.reader_reserve) // ranks
            window = max(self.needs.largest, min(window, share))
        return Prefetcher(
            self.store, self.plan, shard_infos, concurrency=self.prefetch_concurrency,
            max_shards=self.prefetch_shards, max_bytes=window,
        ).start()

    def counters(self) -> dict[str, float]:
        """This process's cache counters: cache_hits, cache_misses, bytes_downloaded,
        download_seconds, peer_download_wait_seconds, and more (verify_seconds, evictions,
        retries, ...)."""
        if self._store_obj is None or self._pid != os.getpid():
            out: dict[str, float] = dict.fromkeys(COUNTER_NAMES, 0)
        else:
            with self._store_obj._mutex:
                out = dict(self._store_obj.counters)
        ranged = self._ranged.counters if self._ranged is not None and self._pid == os.getpid() else None
        out["range_reads"] = ranged.reads if ranged else 0
        out["range_bytes"] = ranged.bytes if ranged else 0
        out["range_requests"] = ranged.requests if ranged else 0
        return out

    def node_counters(self) -> dict[str, int]:
        """Counters of every process that used this cache directory: downloads, redownloads
        (shards downloaded again after an eviction), evictions, bytes_downloaded, and
        high_water (the most bytes committed plus reserved at once)."""
        ledger = self.store.ledger
        return {**ledger.node_counters(), "high_water": ledger.high_water()}

    def close(self) -> None:
        if self._store_obj is not None and self._pid == os.getpid():
            self._store_obj.close()
            self._store_obj = None

    def __repr__(self) -> str:
        return f"RemoteSource({self.root!r}, cache_dir={self.cache_dir!r}, cache_limit={self.cache_limit})"
