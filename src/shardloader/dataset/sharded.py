"""`Dataset`: the map-style view over an indexed, sharded dataset, whatever its format.

`len(ds)` is the number of samples in the index and `ds[i]` is global sample `i` as a dict of
fields, read from the shard that holds it. Fields of WebDataset tar shards are decoded by
extension (``cls`` -> int, ``txt`` -> str, ``json`` -> parsed, ...; see
`shardloader.format.wds_decode`) unless `decode=False`. Readers are opened lazily and per
process, so a Dataset pickles cheaply into worker processes (only the index and the source
travel).

A shard that changes during a run (renamed over, truncated or rewritten in place) is never
read as if it were the file that was verified: a reader whose file changed under it is dropped
and the shard reopened, which verifies the new file against the index again. Either the new
file is what the index describes and reading goes on, or the read is a ShardError naming it.

A Dataset asks its source only what `shardloader.source.protocol.ShardSource` declares (local
and remote sources inherit its null defaults for what they lack), and a Loader asks a Dataset
only what `shardloader.loader.protocol.LoaderDataset` declares: `index`, `source`, `len`,
`get_many`, `shard_wait_seconds`, `check_capacity`, `prime`, `warm_up` and `close`, all
implemented here.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np

from shardloader.errors import DatasetIndexError, ShardChangedError
from shardloader.format.arrays import positions_by_value, sorted_unique
from shardloader.format.index import Index
from shardloader.format.protocol import ShardReader
from shardloader.format.registry import open_shard, shard_format
from shardloader.format.wds_decode import decode_record, decoded_fields
from shardloader.io.paths import is_local, strip_file_scheme
from shardloader.runtime.startup import gc_paused
from shardloader.source.index import load_index
from shardloader.source.local import LocalSource
from shardloader.source.protocol import ShardSource

INDEX_FIELD = "__index__"
KEY_FIELD = "__key__"
#: Opening a shard that keeps changing between verification and opening gives up after this.
_OPEN_ATTEMPTS = 3


class Dataset:
    """A sharded dataset described by `index.json` at `path_or_url`.

    Local paths are read in place. Remote URLs (any fsspec protocol) are read through the
    node's shard cache in `cache_dir`, bounded by `cache_limit` (bytes or a string like
    "200GB"). `verify` checks each shard's size and checksum the first time a process opens it,
    and for local shards again whenever the file's identity (inode, size, mtime, change time)
    changed; with `verify=False` a local shard's size is still checked against the index.
    `max_open_shards` bounds how many shard readers a process keeps open.
    `decode` applies to tar shards: True decodes the conventional WebDataset extensions as
    webdataset does (images stay bytes), False gives every member's raw bytes, and a collection
    of field names decodes only those.
    A local shard that is a symbolic link (or lies under a linked directory) leading out of the
    dataset root is refused with UnsafePathError naming the shard, the link and its target;
    `allow_links_outside_root=True` reads it (links inside the root always work).
    Building a Dataset opens the shards the index lists as empty (a `samples: 0` entry for a
    shard with rows is a ShardError) and refuses an index without samples (DatasetIndexError).
    Idle readers close early when the node cache needs their room.
    `source_options` tunes how a remote dataset is read: further arguments of its shard source
    (`RemoteSource`: `retry`, `chunk_size`, `parallel_ranges`, the `prefetch` knobs,
    `full_timeout`, the `range_` knobs; docs/cache.md, "Knobs"), `retry` also for `index.json`.
    Under a Loader, rows of remote shards not yet in the node cache are read by byte range
    (verified against the index's range sidecars) while whole shards download behind; see
    `shardloader.source.ranged` and docs/cache.md.
    """

    @gc_paused  # on the path to the first batch: no full collection (see shardloader.runtime.startup)
    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        max_open_shards: int = 16,
        decode: bool | Collection[str] = True,
        allow_links_outside_root: bool = False,
        source_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = os.fspath(path_or_url)
        self.storage_options = dict(storage_options or {})
        source_options = _checked_source_options(self.url, source_options)
        self.index: Index = load_index(self.url, self.storage_options, retry=source_options.get("retry"))
        self.source: ShardSource = _make_source(
            self.url, cache_dir=cache_dir, cache_limit=cache_limit,
            storage_options=self.storage_options, verify=verify,
            allow_links_outside_root=allow_links_outside_root, source_options=source_options,
        )
        self.max_open_shards = max_open_shards
        self._tar_decode = decoded_fields(list(self.index.schema), decode)
        self._reset_process_state()
        self._check_empty_shards()
        self._check_not_empty()

    def _check_not_empty(self) -> None:
        """An index without samples would give zero batches and no error: refuse it here."""
        if self.index.num_samples == 0:
            raise DatasetIndexError(
                f"{self.url}: the index lists no samples ({self.index.num_shards} shards, all "
                "with 'samples': 0); there is nothing to load (was the dataset written?)"
            )

    def _check_empty_shards(self) -> None:
        """Open each shard the index calls empty: a `samples: 0` entry for a shard that holds
        rows would silently drop them from every epoch (the reader's count check names both)."""
        for shard in self.index.empty_shards().tolist():  # without a ShardInfo for every shard
            info = self.index.shards[shard]
            path = self.source.local_path(info)
            try:
                open_shard(info, path, self.index.schema).close()
            finally:
                self.source.release(info)

    def _reset_process_state(self) -> None:
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._readers_lock = threading.RLock()
        self._pid = os.getpid()
        self._thread = threading.local()
        self._in_use: Counter[int] = Counter()
        self._releaser_registered = False

    def shard_wait_seconds(self) -> float:
        """Seconds this thread has spent waiting for shard files to become available (download,
        another process's download, verification): the storage share of reading time."""
        if os.getpid() != self._pid:
            self._reset_process_state()
        return getattr(self._thread, "shard_wait_seconds", 0.0)

    def _add_shard_wait(self, seconds: float) -> None:
        """Count `seconds` this thread waited for a shard file (or its rows, by range)."""
        self._thread.shard_wait_seconds = getattr(self._thread, "shard_wait_seconds", 0.0) + seconds

    # -- pickling: only the description travels, never open files ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_readers", "_readers_lock", "_pid", "_thread", "_in_use", "_releaser_registered"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    # -- map-style access ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self.index.num_samples

    def __getitem__(self, sample: int) -> dict[str, Any]:
        sample = int(sample)
        if sample < 0:
            sample += len(self)
        self.index.locate(sample)  # IndexError for a sample out of range
        return self.get_many(np.asarray([sample], dtype=np.int64))[0]

    def get_many(self, samples: Sequence[int] | np.ndarray) -> list[dict[str, Any]]:
        """Samples in the order given, reading each shard's rows in one call."""
        samples = np.asarray(samples, dtype=np.int64)
        shards, rows = self.index.locate_many(samples)
        out: list[dict[str, Any] | None] = [None] * len(samples)
        per_shard = positions_by_value(shards)
        ranged = self._read_by_range([(shard, rows[positions]) for shard, positions in per_shard])
        numbers = samples.tolist()
        for shard, positions in per_shard:
            records = ranged.get(shard)
            if records is None:
                records = self._read_rows(shard, rows[positions].tolist())
            for pos, record in zip(positions.tolist(), records):
                record[INDEX_FIELD] = numbers[pos]
                out[pos] = record
        return out  # type: ignore[return-value]

    def prime(self, samples: Sequence[int] | np.ndarray, *, ahead: bool = False) -> int:
        """Fetch now what reading `samples` by byte range will need (remote shards not yet in
        the node cache; see `RemoteSource.prime_ranges`), so that this process and workers it
        forks afterwards read them without a request. A Loader calls it for its first batch
        before it starts its workers, and from `Loader()` in the background (`ahead`). Returns
        the spans kept (0 for a local dataset)."""
        if not self.source.reads_by_range:
            return 0
        shards, rows = self.index.locate_many(np.asarray(samples, dtype=np.int64))
        return self.source.prime_ranges([(self.index.shards[int(shard)], rows[shards == shard])
                                         for shard in sorted_unique(shards).tolist()], ahead=ahead)

    def _decoded(self, record: dict[str, Any], shard: int, where: str) -> dict[str, Any]:
        """`record` with a tar shard's conventional fields decoded (see `decode`)."""
        if not self._tar_decode or not shard_format(self.index.shards[shard].format).encoded_fields:
            return record
        return decode_record(record, self._tar_decode, where=where)

    def _read_by_range(self, wanted: list[tuple[int, np.ndarray]]) -> dict[int, list[dict[str, Any]]]:
        """Records of the shards in `wanted` ((shard, rows)) that the source reads by byte range
        now (remote shards not yet in the node cache; see `shardloader.source.ranged`), by shard.
        Shards this process has a reader open for are read through it."""
        if not self.source.reads_by_range:
            return {}
        if os.getpid() != self._pid:
            self._reset_process_state()
        with self._readers_lock:
            todo = [(shard, rows) for shard, rows in wanted if shard not in self._readers]
        if not todo:
            return {}
        start = time.perf_counter()
        try:  # network time: the storage share of reading, as a wait for a download
            got = self.source.read_by_range([(self.index.shards[shard], rows) for shard, rows in todo])
        finally:
            self._add_shard_wait(time.perf_counter() - start)
        out = {}
        for pos, records in got.items():
            shard = todo[pos][0]
            where = self.source.url_of(self.index.shards[shard])
            out[shard] = [self._decoded(r, shard, where) for r in records]
        return out

    # -- shard readers ------------------------------------------------------------------------
    def _read_rows(self, shard: int, rows: list[int]) -> list[dict[str, Any]]:
        """Rows of `shard`. A reader whose file changed in place since it was opened is dropped
        and the shard opened again once (verifying the file anew), so the rows come from a file
        that matches the index or the call raises a ShardError naming it."""
        decode = bool(self._tar_decode) and shard_format(self.index.shards[shard].format).encoded_fields
        for attempt in range(2):
            # `_acquire`/`_release` rather than `with self._using(...)`: this runs once per shard
            # of every batch, and the generator-based context manager cost more than the read
            # bookkeeping it wraps.
            reader = self._acquire(shard)
            try:
                records = reader.read_rows(rows)
                if decode:
                    records = [self._decoded(r, shard, getattr(reader, "path", "")) for r in records]
                return records
            except ShardChangedError:
                if attempt:
                    raise
                self._retire(shard, reader)
            finally:
                self._release(shard)
        raise AssertionError("unreachable")

    def _retire(self, shard: int, reader: ShardReader) -> None:
        """Stop handing out `reader` (its file changed). Closed now when no other thread uses
        it; otherwise when the last user drops it (its reads fail the identity check anyway)."""
        with self._readers_lock:
            if self._readers.get(shard) is not reader:
                return  # another thread retired it already
            del self._readers[shard]
            self.source.release(self.index.shards[shard])
            if self._in_use.get(shard) == 1:
                reader.close()

    def reader(self, shard: int) -> ShardReader:
        """The open reader of shard `shard`, opening (and verifying) it on first use.

        Prefer `get_many`: it marks the reader in use while rows are read, whereas a reader
        returned here may be closed by another thread, or when the node cache needs room."""
        with self._using(shard) as reader:
            return reader

    @contextlib.contextmanager
    def _using(self, shard: int) -> Iterator[ShardReader]:
        """The reader of `shard`, protected from LRU closing while the block runs."""
        reader = self._acquire(shard)
        try:
            yield reader
        finally:
            self._release(shard)

    def _release(self, shard: int) -> None:
        """Undo one `_acquire`: the reader may be closed again when over the limit and idle."""
        with self._readers_lock:
            self._in_use[shard] -= 1
            if not self._in_use[shard]:
                del self._in_use[shard]
            self._close_idle_over_limit()

    def _acquire(self, shard: int) -> ShardReader:
        """The reader of `shard`, opened if needed, marked in use (undo with `_release`); a
        forked process first drops the readers it inherited."""
        if os.getpid() != self._pid:
            self._reset_process_state()
        with self._readers_lock:
            reader = self._readers.get(shard)
            if reader is not None:
                self._readers.move_to_end(shard)
                self._in_use[shard] += 1
                return reader
            # Close idle readers first, so a process pins at most max_open_shards shards.
            self._close_idle_over_limit(room_for=1)
            self._register_releaser()
        reader = self._open(shard)
        info = self.index.shards[shard]
        with self._readers_lock:
            existing = self._readers.get(shard)
            if existing is not None:  # another thread opened it meanwhile: keep one
                reader.close()
                self.source.release(info)
                reader = existing
            else:
                self._readers[shard] = reader
            self._readers.move_to_end(shard)
            self._in_use[shard] += 1
            return reader

    def _open(self, shard: int) -> ShardReader:
        """A new reader of `shard` on the file its source verified (pinned by the source until
        released). A file replaced between verification and opening is verified again."""
        info = self.index.shards[shard]
        for attempt in range(_OPEN_ATTEMPTS):
            start = time.perf_counter()
            try:  # outside the lock: this may wait for a download
                path = self.source.local_path(info)
            except ShardChangedError:
                if attempt + 1 == _OPEN_ATTEMPTS:
                    raise
                continue
            finally:
                self._add_shard_wait(time.perf_counter() - start)
            expect = self.source.verified_identity(info)
            try:
                return open_shard(info, path, self.index.schema, expect=expect)
            except ShardChangedError:
                self.source.release(info)
                if attempt + 1 == _OPEN_ATTEMPTS:
                    raise
            except BaseException:
                self.source.release(info)
                raise
        raise AssertionError("unreachable")

    def _close_idle_over_limit(self, room_for: int = 0) -> None:
        """Close least recently used readers that no thread is using (caller holds the lock)."""
        excess = len(self._readers) + room_for - self.max_open_shards
        if excess <= 0:
            return
        for shard in list(self._readers):
            if excess <= 0:
                break
            if self._in_use.get(shard):
                continue
            self._readers.pop(shard).close()
            self.source.release(self.index.shards[shard])
            excess -= 1

    def _register_releaser(self) -> None:
        """Let the node cache close this process's idle readers when a reader needs room
        (caller holds the lock; once per process)."""
        if self._releaser_registered:
            return
        self._releaser_registered = True
        self.source.add_idle_releaser(self.release_idle)

    def release_idle(self) -> int:
        """Close every reader no thread is using now (their shards are unpinned); how many."""
        if os.getpid() != self._pid:
            return 0
        with self._readers_lock:
            idle = [shard for shard in self._readers if not self._in_use.get(shard)]
            for shard in idle:
                self._readers.pop(shard).close()
                self.source.release(self.index.shards[shard])
        return len(idle)

    def check_capacity(self, *, num_workers: int) -> None:
        """Refuse, before anything is read, a cache too small for reading with `num_workers`
        per rank (a CacheFullError stating the minimum); the Loader calls it when iteration
        starts. Local datasets have no cache and pass."""
        self.source.check_capacity(self.index, num_workers=num_workers)

    def warm_up(self) -> None:
        """Load the reader code of this dataset's shard formats and, for shards read in place,
        read one sample (a reader's first read loads what it loads lazily); a remote source
        would download a shard for that, so there only the code is loaded. The Loader calls it
        before forking its workers, which then inherit what it loaded."""
        for fmt in self.index.formats:
            shard_format(fmt).load()
        if self.source.reads_in_place and len(self):
            self.get_many(np.zeros(1, dtype=np.int64))  # workers reopen their own readers

    def check_length(self) -> None:
        """Nothing to check: the index fixes the shards and their sample counts (a shard
        changed on disk is refused when it is read: ShardChangedError)."""
        return None

    def close(self) -> None:
        """Close every open reader of this process."""
        with self._readers_lock:
            while self._readers:
                shard, reader = self._readers.popitem()
                reader.close()
                self.source.release(self.index.shards[shard])

    def __repr__(self) -> str:
        return (
            f"Dataset({self.url!r}, samples={len(self)}, shards={self.index.num_shards}, "
            f"fingerprint={self.index.fingerprint})"
        )


def _make_source(
    url: str,
    *,
    cache_dir: str | os.PathLike[str] | None,
    cache_limit: int | str | None,
    storage_options: dict[str, Any],
    verify: bool,
    allow_links_outside_root: bool,
    source_options: dict[str, Any],
) -> ShardSource:
    if is_local(url):
        return LocalSource(strip_file_scheme(url), verify=verify,
                           allow_links_outside_root=allow_links_outside_root)
    from shardloader.source.remote import RemoteSource  # the cache issue provides this

    return RemoteSource(url, cache_dir=cache_dir, cache_limit=cache_limit, storage_options=storage_options,
                        **source_options)


#: `Dataset` arguments of its own that `source_options` may not repeat.
_OWN_SOURCE_ARGUMENTS = frozenset({"url", "cache_dir", "cache_limit", "storage_options"})


def _checked_source_options(url: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` when every key is a `RemoteSource` argument and `url` is remote; else a
    ValueError naming the argument and what is wrong (a local dataset has no download to tune)."""
    options = dict(options or {})
    if not options:
        return options
    if is_local(url):
        raise ValueError(f"source_options: {url!r} is a local dataset, read in place; "
                         f"{sorted(options)} only tune reading a remote one")
    import inspect

    from shardloader.source.remote import RemoteSource

    known = set(inspect.signature(RemoteSource).parameters) - _OWN_SOURCE_ARGUMENTS
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"source_options: unknown {unknown} (the Dataset's own arguments are passed "
                         f"as such; the others are {sorted(known)})")
    return options
