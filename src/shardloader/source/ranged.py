"""Reading rows of shards the node cache does not hold yet, by byte range.

With a cold cache, the first batches would wait for every shard they draw from to download
whole (partitions x window shards: 16 with the defaults). Instead, a reader that needs rows of
a shard not yet in the cache fetches just the byte spans those rows live in (see
`shardloader.format.ranges`), for all shards of a batch in one concurrent round of requests,
while the prefetcher downloads whole shards behind it. Once a shard is whole and verified in the
cache, readers use the cache as before; the cache still ends with whole, verified shards (I6).

Per batch that is two rounds of requests at most: the shards' range sidecars (once per shard
and process, kept in memory) and the spans. Spans of one shard that lie close together
(`gap` bytes apart or less) are fetched as one request: on object stores a request costs far
more than a few kB of transfer.

Verification. A sidecar must match its index entry (size, checksum) and every span its xxh3-64
in the sidecar. A span that does not match is fetched once more (a body damaged in transit);
if it still does not match, the remote object is not the one the index describes, and the read
is a `ChecksumMismatch` naming the shard's URL and the byte range: never wrong rows. A sidecar
that is missing or does not verify is a warning, and that shard is read whole, as before.

Sidecars are entries of the node cache (`shardloader.cache.sidecars`): fetched once per node,
by whichever process needs one first, under its download lock (the others wait for it and read
the file), verified against the index, committed like a shard and counted in the cache limit;
eviction and `shardloader cache prune` remove them like shards. A process keeps the sidecars it
decoded in memory (at most `max_shards`).

The first batch. Before a Loader forks its workers, the training process fetches everything its
first batch reads by range (`prime`: sidecars, then spans, verified) and keeps it; the workers
inherit it with the fork (`after_fork`), so the first batch's worker reads its rows without a
request and the next batches' requests do not compete with the first's. Measured with 2 workers
on loopback moto (which serves one request at a time), speed.py's cold first batch: the priming
and the lighter S3 client of `shardloader.io.s3client` together took it from 1.34 s to 0.38 s
(medians of 7 fresh processes, alternated). The first batch is primed earlier still, in a
background thread started when the Loader is made (`shardloader.loader.prefetch_policy.
warm_first_batch`; only its sidecars, `warm(first_batch=True)`, where workers are spawned), so
that its rounds overlap what the script does before it iterates; primes run one at a time, so
the priming at `iter()` waits for that one and finds its spans kept. What is fetched for the
first batch reaches the node cache only once the batch is out (`release_held`), so that it
waits for no commit. After the fork a background thread of the training process fetches the
sidecars of the next batches' shards (`warm`) for the workers to find on the node; a worker
that needs a sidecar the thread is fetching waits for that fetch (the sidecar's download lock)
instead of fetching it again, and fetches what is not on the node itself. A background fetch
that fails is never taken for "read that shard whole": the read that needs the sidecar fetches
it again, and raises what is not transient (see `_states`).

Bounds. Per node and shard, reads by range fetch at most `budget` (a fraction of the shard's
size), counted for every process that shares the node cache (`shardloader.cache.range_spend`);
a read that would pass it waits for the whole shard instead, so range reads cost at most that
fraction on top of the whole download, whatever the prefetcher does and however many processes
read the shard.
"""

from __future__ import annotations

import logging
import random
import threading
import warnings
from collections import ChainMap, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import shardloader.cache.range_spend as range_spend
from shardloader.cache.layout import cache_name, sidecar_name
from shardloader.cache.sidecars import SidecarWant, load_sidecars, matches
from shardloader.cache.store import ShardCache
from shardloader.errors import ChecksumMismatch, ShardloaderError, UnsafePathError
from shardloader.format.arrays import sorted_unique
from shardloader.format.index import ShardInfo
from shardloader.format.ranges import RANGES_KEY, RangeTable, span_hash
from shardloader.format.registry import rows_from_spans, shard_format
from shardloader.io.paths import join_url, safe_relative_path
from shardloader.io.retry import RetryPolicy
from shardloader.io.transfer import FetchStats, RangeRequest, read_ranges
from shardloader.source.span_requests import DEFAULT_GAP, coalesce, gaps_by_cost

log = logging.getLogger(__name__)

#: Shared and group spans (Arrow batch metadata) up to this size are kept for the next reads of
#: their shard; larger ones (Parquet row groups) are not, to bound memory per process.
_MAX_KEPT = 1 << 20


@dataclass
class _ShardState:
    table: RangeTable
    tar: Any  # TarOffsets of a tar shard, else None
    kept: dict[int, bytes] = field(default_factory=dict)  # shared and group spans fetched


@dataclass
class RangeCounters:
    reads: int = 0  # shard reads served by range
    bytes: int = 0  # bytes received by range (sidecars included)
    requests: int = 0
    seconds: float = 0.0


class RangeReads:
    """One process's reads by range. Thread-safe; `read` may run in many threads at once."""

    def __init__(
        self,
        filesystem: Callable[[], tuple[Any, str]],
        root: str,
        *,
        cache: Callable[[], ShardCache],
        policy: RetryPolicy,
        gap: int = DEFAULT_GAP,
        budget: float = 0.25,
        max_shards: int = 64,
    ) -> None:
        self._filesystem = filesystem
        self._cache = cache  # this process's handle on the node cache, where sidecars live
        self.root = root
        self.policy = policy
        self.gap = gap
        self.budget = budget
        self.max_shards = max_shards
        self.counters = RangeCounters()
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._shards: OrderedDict[str, _ShardState | None] = OrderedDict()  # None: read whole
        self._loading: dict[str, threading.Event] = {}  # sidecars being fetched by a thread
        self._failed: dict[str, BaseException] = {}  # why a background fetch of a sidecar failed
        self._first_out = threading.Event()  # a Loader's first batch is out: see `release_held`
        self._priming = threading.Lock()  # one `prime` at a time

    # -- public --------------------------------------------------------------------------------
    def read(self, wanted: Sequence[tuple[ShardInfo, np.ndarray]]) -> dict[int, list[dict[str, Any]]]:
        """Records of the rows of each (shard, rows) in `wanted` that can be read by range, by
        position in `wanted`; shards left out are to be read whole."""
        states = self._states([info for info, _ in wanted])
        plans: list[tuple[int, ShardInfo, np.ndarray, _ShardState, np.ndarray, int]] = []
        with self._lock:
            for pos, (info, rows) in enumerate(wanted):
                state = states.get(info.path)
                if state is None:
                    continue
                ids = state.table.needed(rows)
                have = state.table.inline
                missing = np.asarray([i for i in ids.tolist() if i not in state.kept and i not in have],
                                     dtype=np.int64)
                gap = self._spend(info, state.table, missing)
                if gap is None:
                    continue  # reading on by range would cost more than waiting for the shard
                plans.append((pos, info, np.asarray(rows, dtype=np.int64), state, missing, gap))
        if not plans:
            return {}
        fetched = self._fetch_spans([(info, state.table, missing, gap)
                                     for _, info, _, state, missing, gap in plans])
        out: dict[int, list[dict[str, Any]]] = {}
        for (pos, info, rows, state, _, _), spans in zip(plans, fetched):
            keep = set(state.table.shared.tolist())
            groups = sorted_unique(state.table.groups_of(rows)).tolist()
            for g in groups:
                keep.update(state.table.group_ids[state.table.group_ptr[g]:state.table.group_ptr[g + 1]].tolist())
            with self._lock:
                for i in keep.intersection(spans):
                    if len(spans[i]) <= _MAX_KEPT:  # a Parquet row group is fetched per read
                        state.kept[i] = spans[i]
                have = ChainMap(spans, dict(state.kept), state.table.inline)  # what the rows need
                self.counters.reads += 1
            out[pos] = rows_from_spans(state.table, have, rows, where=self._url(info.path),
                                       tar_offsets=state.tar)
        return out

    def prime(self, wanted: Sequence[tuple[ShardInfo, np.ndarray]], *, hold: bool = False,
              background: bool = False) -> int:
        """Fetch, verify and keep the spans that reading the rows of `wanted` needs (and the
        sidecars of their shards), so that those reads need no request: in this process, and in
        worker processes forked after this returns, which inherit what it kept. A Loader calls
        it for its first batch before it forks its workers (see `RemoteSource.prime_ranges`).
        Spans over `_MAX_KEPT` (Parquet row groups) are left to the reads. Returns the number
        of spans kept. Never raises: the read that needs the rows fetches (and reports) itself.
        `hold`: the sidecars fetched are committed to the node cache only once the first batch
        is out (`release_held`): the workers inherit them, and the batch does not wait for the
        commits. One prime at a time: a Loader primes its first batch from `Loader()`, in the
        background, and again at `iter()`; the second waits for the first and finds its spans
        kept, instead of fetching them again. `background`: the sidecars are fetched as `warm`
        fetches them (a failure leaves them to the next reader, see `_states`)."""
        with self._priming:
            return self._prime(wanted, hold=hold, background=background)

    def _prime(self, wanted: Sequence[tuple[ShardInfo, np.ndarray]], *, hold: bool, background: bool) -> int:
        try:
            states = self._states([info for info, _ in wanted], hold=hold, background=background)
            work: list[tuple[ShardInfo, _ShardState, np.ndarray, int]] = []
            with self._lock:
                for info, rows in wanted:
                    state = states.get(info.path)
                    if state is None:
                        continue
                    ids = state.table.needed(rows)
                    small = state.table.spans[ids, 1] <= _MAX_KEPT
                    missing = np.asarray([i for i in ids[small].tolist()
                                          if i not in state.kept and i not in state.table.inline],
                                         dtype=np.int64)
                    gap = self._spend(info, state.table, missing) if len(missing) else None
                    if gap is None:
                        continue
                    work.append((info, state, missing, gap))
            if not work:
                return 0
            fetched = self._fetch_spans([(info, state.table, missing, gap) for info, state, missing, gap in work])
            with self._lock:
                for (_, state, _, _), spans in zip(work, fetched):
                    state.kept.update(spans)
            return sum(len(spans) for spans in fetched)
        except Exception:  # noqa: BLE001 - an optimisation: the reads fetch what they need
            log.debug("priming reads by range failed", exc_info=True)
            return 0

    def _gap(self, table: RangeTable) -> int:
        """How far apart spans of this shard may lie and still share a request: `gap`, but at
        most 1/16 of the shard, so that a read of a few rows of a small shard never transfers
        most of it (it would rather wait for the whole shard, see `budget`)."""
        return min(self.gap, table.shard_bytes // 16)

    def _spend(self, info: ShardInfo, table: RangeTable, ids: np.ndarray) -> int | None:
        """The gap to fetch spans `ids` of `info` with, their bytes counted for the node (in the
        cache: `shardloader.cache.range_spend`) against `budget` of the shard's size: the widest
        joining of the spans whose bytes still fit (`span_requests.gaps_by_cost`: fewest
        requests within the budget), so that a first batch read by several processes at once
        stays within it; None when even the spans alone would pass it (the reader then waits
        for the whole shard)."""
        if not len(ids):
            return self._gap(table)
        return range_spend.spend_first(self._cache().layout, cache_name(info),
                                       gaps_by_cost(table.spans[ids], self._gap(table)),
                                       self.budget * info.bytes)

    def release_held(self) -> None:
        """The first batch is out: commit the sidecars fetched for it (see `prime`, `warm`)."""
        self._first_out.set()

    def after_fork(self) -> RangeReads:
        """This object, made safe to use in a forked child: the tables and spans it holds are
        kept (that is what the child inherits them for); locks, loads in flight (threads do
        not cross a fork), counters and the jitter source start anew."""
        self._lock = threading.Lock()
        self._priming = threading.Lock()
        self._loading = {}
        self._failed = {}
        self._first_out = threading.Event()
        self._first_out.set()  # a child holds nothing: its parent's first batch is its concern
        self.counters = RangeCounters()
        self._rng = random.Random()
        return self

    # -- sidecars ------------------------------------------------------------------------------
    def _url(self, relative: str) -> str:
        return join_url(self.root, relative)

    def _states(self, infos: Sequence[ShardInfo], *, background: bool = False,
                hold: bool = False) -> dict[str, _ShardState | None]:
        """Each shard's range table: loaded already, being loaded by another thread of this
        process (waited for: a background fetch and a reader must not fetch the same sidecars
        twice), or fetched now, all in one round.

        A `background` fetch that fails leaves its shards unknown, not "read whole": the thread
        that needs one of them next fetches it again itself (logging why the first fetch
        failed), so a failure there is retried where the sidecar is needed, and raised there if
        it is not transient, never lost. So is a wait that outlasts the retry deadline."""
        with self._lock:
            known = {info.path: self._shards[info.path] for info in infos if info.path in self._shards}
            for path in known:
                self._shards.move_to_end(path)
            others = {info.path: self._loading[info.path] for info in infos
                      if info.path not in known and info.path in self._loading}
            todo = [info for info in {i.path: i for i in infos}.values()
                    if info.path not in known and info.path not in others]
            done = threading.Event()
            for info in todo:
                self._loading[info.path] = done
            failed = {info.path: self._failed.pop(info.path) for info in todo if info.path in self._failed}
        self._say_retrying(failed)
        try:
            known.update(self._load(todo, strict=background, hold=hold))
        except Exception as e:
            if not background:
                raise
            with self._lock:
                self._failed.update(dict.fromkeys((info.path for info in todo), e))
        finally:
            with self._lock:
                for info in todo:
                    self._loading.pop(info.path, None)
            done.set()
        again: list[ShardInfo] = []  # the thread waited for failed: fetched here (it says why)
        late: list[ShardInfo] = []  # still not done after the deadline: fetched here regardless
        by_path = {info.path: info for info in infos}
        for path, event in others.items():
            finished = event.wait(self.policy.deadline)
            with self._lock:
                if path in self._shards:
                    known[path] = self._shards[path]
                elif not background:
                    (again if finished else late).append(by_path[path])
        if again:
            known.update(self._states(again, hold=hold))
        if late:
            known.update(self._load(late, hold=hold))
        return known

    def _say_retrying(self, failed: dict[str, BaseException]) -> None:
        for path, error in failed.items():
            log.warning("%s: the background fetch of its range sidecar failed (%s); fetching it again",
                        self._url(path), error)

    def _load(self, todo: list[ShardInfo], *, strict: bool = False,
              hold: bool = False) -> dict[str, _ShardState | None]:
        """Find on the node (or fetch once for the node) and decode the sidecars of `todo`.
        `strict`: a failed round of requests raises (FetchError) instead of meaning "read
        those shards whole". `hold`: for the first batch, committed to the node once it is out
        (`release_held`; see `load_sidecars`)."""
        known: dict[str, _ShardState | None] = {}
        if not todo:
            return known
        wanted: list[tuple[ShardInfo, str, SidecarWant, str]] = []  # info, kind, want, relative
        for info in {i.path: i for i in todo}.values():
            entries = _sidecars(info)
            if entries is None:
                self._remember(info.path, None)
                known[info.path] = None
                continue
            wanted += [(info, kind, SidecarWant(name, size, checksum, self._url(rel)), rel)
                       for kind, (rel, size, checksum, name) in entries.items()]
        if not wanted:
            return known
        paths = {want.name: rel for _, _, want, rel in wanted}
        blobs = load_sidecars(self._cache(), [want for _, _, want, _ in wanted],
                              lambda wants: self._fetch_sidecars(wants, paths, strict=strict),
                              hold=self._first_out if hold else None)
        loaded: dict[str, dict[str, bytes]] = {}
        for (info, kind, _, _), blob in zip(wanted, blobs):
            if blob is not None:
                loaded.setdefault(info.path, {})[kind] = blob
        for info in {i.path: i for i, *_ in wanted}.values():
            state = self._decode(info, loaded.get(info.path, {}))
            self._remember(info.path, state)
            known[info.path] = state
        return known

    def _fetch_sidecars(self, wants: list[SidecarWant], paths: dict[str, str], *,
                        strict: bool = False) -> list[bytes | None]:
        """The sidecars `wants` (relative paths in `paths`) fetched in one round of requests;
        None (with a warning: that shard is read whole) for those that do not match their index
        entry, and for all when the round fails (unless `strict`: then it raises). Called by the
        node cache with their download locks held."""
        fs, base = self._filesystem()
        requests = []
        for want in wants:
            rel = paths[want.name]
            requests.append(RangeRequest(join_url(base, rel) if base else rel, want.what, 0, want.bytes, want.bytes))
        try:
            data, stats = read_ranges(fs, requests, policy=self.policy, rng=self._rng)
        except ShardloaderError as e:
            if strict:
                raise
            warnings.warn(f"range sidecars not readable ({e}); reading those shards whole", stacklevel=2)
            return [None] * len(wants)
        self._count(stats, len(requests))
        out: list[bytes | None] = []
        for want, blob in zip(wants, data):
            if matches(blob, want):
                out.append(blob)
                continue
            if blob or want.bytes == 0:
                warnings.warn(f"{want.what}: sidecar does not match its index entry (size or "
                              "checksum); reading the shard whole", stacklevel=2)
            out.append(None)
        return out

    def warm(self, infos: Sequence[ShardInfo], *, first_batch: bool = False) -> None:
        """Load the sidecars of `infos` (from the node, else remotely once for the node) into
        this process and the node cache: a Loader calls this in a background thread of the
        training process, when it is made (for its first batch) and while its workers start
        (for the next ones), so that those reads need no sidecar round of their own. A reader
        that needs one of them waits for it; if its fetch failed, it fetches it again itself
        (see `_states`): a failure here is never taken for "read that shard whole".
        `first_batch`: committed to the node once it is out, as `prime(hold=True)`."""
        try:
            self._states(infos, background=True, hold=first_batch)
        except Exception:  # noqa: BLE001 - `_states` keeps what failed for the reads to retry
            log.debug("warming range sidecars failed", exc_info=True)

    def _decode(self, info: ShardInfo, blobs: dict[str, bytes]) -> _ShardState | None:
        fmt = shard_format(info.format)
        if "ranges" not in blobs or (fmt.companion is not None and fmt.companion.key not in blobs):
            return None
        where = self._url(info.path)
        try:
            table = RangeTable.decode(blobs["ranges"], where=where + ".ranges")
            tar = None
            if fmt.companion is not None:
                tar = fmt.decode_companion(blobs[fmt.companion.key], where=where + fmt.companion.suffix)
                if len(tar) != info.samples:
                    raise ShardloaderError(f"{where}: offsets sidecar lists {len(tar)} samples, "
                                           f"the index {info.samples}")
            if table.shard_bytes != info.bytes or table.rows != info.samples or table.format != info.format:
                raise ShardloaderError(f"{where}.ranges: describes a {table.format} file of "
                                       f"{table.shard_bytes} bytes and {table.rows} rows, the index a "
                                       f"{info.format} file of {info.bytes} bytes and {info.samples} rows")
        except ShardloaderError as e:
            warnings.warn(f"{e}; reading the shard whole", stacklevel=5)
            return None
        return _ShardState(table, tar)

    def _remember(self, path: str, state: _ShardState | None) -> None:
        with self._lock:
            self._shards[path] = state
            self._shards.move_to_end(path)
            while len(self._shards) > self.max_shards:
                self._shards.popitem(last=False)

    # -- spans ---------------------------------------------------------------------------------
    def _fetch_spans(self, work: list[tuple[ShardInfo, RangeTable, np.ndarray, int]]) -> list[dict[int, bytes]]:
        """For each (shard, table, span ids, gap): the verified bytes of those spans, all shards'
        requests in one concurrent round (plus one more for spans that did not verify)."""
        fs, base = self._filesystem()
        results: list[dict[int, bytes]] = [{} for _ in work]
        todo = list(range(len(work)))
        for attempt in range(2):
            requests: list[RangeRequest] = []
            owners: list[tuple[int, int, list[int]]] = []  # (work item, lo, span ids)
            for w in todo:
                info, table, ids, gap = work[w]
                ids = np.asarray([i for i in ids.tolist() if i not in results[w]], dtype=np.int64)
                if not len(ids):
                    continue
                rel = join_url(base, info.path) if base else info.path
                for lo, hi, members in coalesce(table.spans[ids], gap):
                    requests.append(RangeRequest(rel, self._url(info.path), lo, hi, info.bytes))
                    owners.append((w, lo, [int(ids[m]) for m in members]))
            if not requests:
                break
            data, stats = read_ranges(fs, requests, policy=self.policy, rng=self._rng)
            self._count(stats, len(requests))
            bad: list[tuple[int, int, int]] = []  # (work item, offset, length)
            for (w, lo, ids), blob in zip(owners, data):
                table = work[w][1]
                for i in ids:
                    offset, length = table.spans[i].tolist()
                    piece = blob[offset - lo:offset - lo + length]
                    if span_hash(piece) == int(table.hashes[i]):
                        results[w][i] = piece
                    else:
                        bad.append((w, offset, length))
            if not bad:
                break
            if attempt:
                w, offset, length = bad[0]
                raise ChecksumMismatch(
                    f"{self._url(work[w][0].path)}: bytes {offset}-{offset + length - 1} read by range "
                    f"do not match the hash the index's range sidecar records for them (read twice): "
                    f"the remote object is not the one that was indexed (changed after indexing?); "
                    f"refusing to use its rows ({len(bad)} span(s) differ)"
                )
            todo = sorted({w for w, _, _ in bad})
        return results

    def _count(self, stats: FetchStats, requests: int) -> None:
        with self._lock:
            self.counters.bytes += stats.bytes_received
            self.counters.requests += requests
            self.counters.seconds += stats.seconds


def _sidecars(info: ShardInfo) -> dict[str, tuple[str, int, str, str]] | None:
    """(relative path, bytes, checksum, cache name) of the sidecars a read by range of `info`
    needs, by kind, or None when the index describes none (an index written before range
    sidecars existed) or one that cannot be used."""
    companion = shard_format(info.format).companion
    keys = {"ranges": RANGES_KEY} if companion is None else {"ranges": RANGES_KEY, companion.key: companion.key}
    out = {}
    for kind, key in keys.items():
        entry = info.extra.get(key)
        if not isinstance(entry, dict):
            return None
        rel, size, checksum = entry.get("path"), entry.get("bytes"), entry.get("checksum")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return None
        try:
            rel = safe_relative_path(rel, what=f"{info.path}: {kind} sidecar")
            name = sidecar_name(str(checksum), kind)
        except (UnsafePathError, ValueError) as e:
            log.warning("%s: not reading by range: %s sidecar: %s", info.path, kind, e)
            return None
        out[kind] = (rel, size, str(checksum), name)
    return out
