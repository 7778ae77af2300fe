"""The node shard cache in one process: content addressing, verification, LRU eviction within a
hard limit, pins, clear errors, recovery of bookkeeping (invariant I6).

Shards come from a real fsspec filesystem (a `file://` URL read through RemoteSource, exactly the
code path of s3:// and http://, which tests/test_remote_*.py cover against real servers).
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading

import pytest

from shardloader.cache.layout import cache_name
from shardloader.cache.ledger import Reservation
from shardloader.cache.maintenance import usage as usage_of
from shardloader.dataset.sharded import Dataset
from shardloader.errors import CacheFullError, ShardError
from shardloader.format.index import ShardInfo
from shardloader.ingest.writer import write_shards
from shardloader.io.checksum import checksum_file
from shardloader.source.remote import RemoteSource
from tests.fixtures.data import copy_dataset


def uniform_samples(n: int, size: int = 3000, seed: int = 0) -> list[dict]:
    return [{"data": hashlib.sha256(f"{seed}-{i}".encode()).digest() * (size // 32), "label": i}
            for i in range(n)]


@pytest.fixture(scope="module")
def six_shards(tmp_path_factory):
    """6 Arrow shards of 20 samples (about 60 KB each)."""
    path = str(tmp_path_factory.mktemp("six") / "ds")
    index = write_shards(uniform_samples(120), path, shard_samples=20)
    return path, index


def source(ds, cache, limit, **kw):
    kw.setdefault("full_timeout", 0.5)
    return RemoteSource("file://" + ds, cache_dir=str(cache), cache_limit=limit, **kw)


def cached_names(cache) -> set[str]:
    root = os.path.join(cache, "data")
    return {name for sub in os.listdir(root) for name in os.listdir(os.path.join(root, sub))}


def read_and_release(src, info) -> bytes:
    path = src.local_path(info)
    with open(path, "rb") as f:
        data = f.read()
    src.release(info)
    return data


def test_cached_file_is_content_addressed_private_and_whole(six_shards, tmp_path):
    ds, index = six_shards
    cache = tmp_path / "cache"
    src = source(ds, cache, "10MB")
    info = index.shards[0]
    path = src.local_path(info)
    algorithm, digest = info.checksum.split(":")
    assert path == os.path.join(cache, "data", digest[:2], f"{algorithm}-{digest}.arrow")
    assert open(path, "rb").read() == open(os.path.join(ds, info.path), "rb").read()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for d in ("", "data", "tmp", "locks", "index", os.path.join("data", digest[:2])):
        assert stat.S_IMODE(os.stat(os.path.join(cache, d)).st_mode) == 0o700
    assert os.listdir(cache / "tmp") == []
    counters = src.counters()
    assert (counters["cache_misses"], counters["cache_hits"], counters["bytes_downloaded"]) == (1, 0, info.bytes)
    assert src.local_path(info) == path and src.counters()["cache_hits"] == 1  # pinned twice
    src.release(info)
    src.release(info)


def test_a_second_process_view_hits_the_cache_and_verifies_once(six_shards, tmp_path):
    ds, index = six_shards
    first, second = source(ds, tmp_path, "10MB"), source(ds, tmp_path, "10MB")
    read_and_release(first, index.shards[1])
    read_and_release(second, index.shards[1])
    read_and_release(second, index.shards[1])
    c = second.counters()
    assert (c["cache_hits"], c["cache_misses"], c["bytes_downloaded"]) == (2, 0, 0)
    assert c["verify_seconds"] > 0


def test_a_bit_flip_in_the_cache_is_detected_and_fetched_again(six_shards, tmp_path, caplog):
    ds, index = six_shards
    info = index.shards[2]
    original = open(os.path.join(ds, info.path), "rb").read()
    path = source(ds, tmp_path, "10MB").local_path(info)
    with open(path, "r+b") as f:  # damage it behind the cache's back
        f.seek(info.bytes // 2)
        byte = f.read(1)
        f.seek(info.bytes // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    assert checksum_file(path)[0] != info.checksum
    fresh = source(ds, tmp_path, "10MB")  # another process: verifies on first open
    assert read_and_release(fresh, info) == original
    c = fresh.counters()
    assert (c["corrupt_refetched"], c["cache_misses"], c["bytes_downloaded"]) == (1, 1, info.bytes)
    assert checksum_file(path)[0] == info.checksum
    warned = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(warned) == 1 and info.path in warned[0]
    assert f"instead of {info.checksum}" in warned[0]


def test_damage_after_this_process_verified_is_caught_on_the_next_open(six_shards, tmp_path, caplog):
    ds, index = six_shards
    info = index.shards[3]
    src = source(ds, tmp_path, "10MB")
    path = src.local_path(info)
    src.release(info)
    with open(path, "r+b") as f:
        f.truncate(info.bytes - 100)  # truncated: size and mtime change
    assert read_and_release(src, info) == open(os.path.join(ds, info.path), "rb").read()
    assert src.counters()["corrupt_refetched"] == 1
    assert any(f"{info.bytes - 100} bytes, index says {info.bytes};" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_rewrite_in_place_with_mtime_put_back_is_fetched_again(six_shards, tmp_path, caplog):
    """Issue 25 item 4: a cached file rewritten in place (same size and inode, mtime restored)
    is hashed again on the next open (its inode change time moved), removed and fetched again;
    the file this process downloaded itself is trusted on its next opens (its identity is taken
    after the rename that installed it, which moves the change time too)."""
    from tests.test_format_identity import rewrite_keeping_mtime

    ds, index = six_shards
    info = index.shards[2]
    src = source(ds, tmp_path, "10MB")
    good = open(os.path.join(ds, info.path), "rb").read()
    assert read_and_release(src, info) == good
    assert read_and_release(src, info) == good
    assert src.counters()["verify_seconds"] == 0  # downloaded and hashed here: not again
    path = src.store.path_for(info)
    rewrite_keeping_mtime(path, bytes(len(good)))
    assert read_and_release(src, info) == good
    assert src.counters()["corrupt_refetched"] == 1 and src.counters()["downloads"] == 2
    warned = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"{info.path}: cached file {path}")


def usage(src) -> int:
    u = usage_of(src.store)
    return u["data_bytes"] + u["tmp_bytes"]


def test_lru_eviction_keeps_the_cache_within_its_limit(six_shards, tmp_path):
    ds, index = six_shards
    s = index.shards
    limit = int(max(x.bytes for x in s) * 2.5)
    src = source(ds, tmp_path, limit)
    name = [cache_name(x) for x in s]
    for i in (0, 1, 2):
        read_and_release(src, s[i])
        assert usage(src) <= limit
    assert cached_names(tmp_path) == {name[1], name[2]}  # 0 was least recently used
    read_and_release(src, s[1])  # touch 1: now 2 is the oldest
    read_and_release(src, s[3])
    assert cached_names(tmp_path) == {name[1], name[3]}
    assert usage(src) <= limit
    assert src.counters()["evictions"] == 2


def test_pinned_shards_are_never_evicted_and_a_full_cache_is_a_clear_error(six_shards, tmp_path):
    ds, index = six_shards
    s = index.shards
    limit = int(max(x.bytes for x in s) * 2.5)
    src = source(ds, tmp_path, limit, full_timeout=30)  # own pins: fails at once, no waiting
    p0, p1 = src.local_path(s[0]), src.local_path(s[1])
    with pytest.raises(CacheFullError, match=r"no room for shard shard-00002.arrow .* pin .* in this process"):
        src.local_path(s[2])
    assert os.path.exists(p0) and os.path.exists(p1)
    assert os.listdir(tmp_path / "tmp") == []
    src.release(s[0])
    read_and_release(src, s[2])
    assert not os.path.exists(p0) and os.path.exists(p1)


def test_a_shard_larger_than_the_limit_is_a_clear_error(six_shards, tmp_path):
    ds, index = six_shards
    src = source(ds, tmp_path, 1000)
    with pytest.raises(CacheFullError, match=r"shard-00000.arrow .* larger than the whole cache limit"):
        src.local_path(index.shards[0])


@pytest.mark.parametrize("digest", [" 1f" * 8, "0x" + "1f" * 8, "-" + "1f" * 8, "1_f" * 8, "AB" * 8])
def test_checksums_that_would_make_odd_file_names_are_rejected(six_shards, tmp_path, digest):
    ds, index = six_shards
    good = index.shards[0]
    bad = ShardInfo(good.path, good.format, good.samples, good.bytes, "xxh3_128:" + digest)
    src = source(ds, tmp_path, "10MB")
    with pytest.raises(ShardError, match="shard-00000.arrow: checksum .*(cannot name a cache file|not hexadecimal)"):
        src.local_path(bad)
    assert cached_names(tmp_path) == set()


def test_lost_bookkeeping_is_rebuilt_from_the_files(six_shards, tmp_path):
    """A process killed between rename and bookkeeping (here: the index deleted) leaves a whole
    file that is not in the index; the next process counts it, so the limit still holds."""
    ds, index = six_shards
    s = index.shards
    limit = int(max(x.bytes for x in s) * 1.5)
    read_and_release(source(ds, tmp_path, limit), s[0])
    import shutil

    shutil.rmtree(tmp_path / "index")
    src = source(ds, tmp_path, limit)
    read_and_release(src, s[1])
    assert cached_names(tmp_path) == {cache_name(s[1])}
    assert src.counters()["evictions"] == 1


def test_leftovers_of_a_dead_downloader_are_removed_and_not_counted(six_shards, tmp_path):
    ds, index = six_shards
    s = index.shards
    src = source(ds, tmp_path, s[0].bytes)  # room for exactly one shard
    store = src.store
    name = cache_name(s[1])
    leftover = tmp_path / "tmp" / f"{name}.999999.abcdef.part"
    leftover.write_bytes(b"partial")
    store.ledger.reserve(name, Reservation(s[1].bytes, 999999))  # no lock holder
    fresh = source(ds, tmp_path, s[0].bytes)
    assert read_and_release(fresh, s[0]) == open(os.path.join(ds, s[0].path), "rb").read()
    assert not leftover.exists()
    assert name not in store.ledger.reservations()


def test_a_local_dataset_is_never_copied_or_evicted(six_shards, tmp_path):
    ds, index = six_shards
    local = copy_dataset(ds, tmp_path)
    before = {n: open(os.path.join(local, n), "rb").read() for n in os.listdir(local)}
    # A local Dataset reads in place, whatever cache it is given.
    local_ds = Dataset(local, cache_dir=str(tmp_path / "cache"), cache_limit=1)
    assert [r["label"] for r in local_ds.get_many(range(120))] == list(range(120))
    local_ds.close()
    # Even a cache pointed (wrongly) at the local dataset's folder evicts only its own files.
    remote = source(ds, local, int(max(x.bytes for x in index.shards) * 1.5))
    for info in index.shards:
        read_and_release(remote, info)
    assert remote.counters()["evictions"] == len(index.shards) - 1
    after = {n: open(os.path.join(local, n), "rb").read() for n in before}
    assert after == before
    assert not os.path.exists(os.path.join(tmp_path, "cache", "data")) or cached_names(tmp_path / "cache") == set()


def test_the_cache_limit_does_not_change_what_is_read(six_shards, tmp_path):
    ds, index = six_shards
    order = [(i * 37) % 120 for i in range(120)]
    small = Dataset("file://" + ds, max_open_shards=1)  # local, for reference
    reference = small.get_many(order)
    for limit in (int(max(x.bytes for x in index.shards) * 1.2), "100MB"):
        remote = source(ds, tmp_path / str(limit), limit)
        got = []
        for i in order:
            shard, row = index.locate(i)
            from shardloader.format.registry import open_shard

            reader = open_shard(index.shards[shard], remote.local_path(index.shards[shard]))
            got.append(reader.read(row))
            reader.close()
            remote.release(index.shards[shard])
        assert [g["data"] for g in got] == [r["data"] for r in reference]


def test_idle_readers_give_up_their_pins_when_a_read_needs_room(six_shards, tmp_path, http_server):
    """A Dataset keeps up to max_open_shards readers open, each pinning its shard; a read that
    needs room closes the idle ones instead of failing with CacheFullError."""
    ds, index = six_shards
    biggest = max(x.bytes for x in index.shards)
    remote = Dataset(http_server(ds).url, cache_dir=str(tmp_path), cache_limit=int(biggest * 2.5),
                     max_open_shards=16)
    local = Dataset(ds)
    order = list(range(120)) + list(reversed(range(120)))
    for i in order:  # one sample at a time: every shard change opens a reader
        assert remote[i]["data"] == local[i]["data"]
    counters = remote.source.counters()
    assert counters["idle_released"] > 0 and counters["evictions"] > 0
    assert usage(remote.source) <= int(biggest * 2.5)
    remote.close()


def test_a_reader_in_use_is_not_released(six_shards, tmp_path, http_server):
    ds, index = six_shards
    biggest = max(x.bytes for x in index.shards)
    remote = Dataset(http_server(ds).url, cache_dir=str(tmp_path), cache_limit=int(biggest * 1.5),
                     max_open_shards=16)
    remote.source.full_timeout = 0.5  # before the first use opens the cache
    with remote._using(0):  # shard 0 is being read, and only one shard fits
        with pytest.raises(CacheFullError, match="no room for shard shard-00001.arrow"):
            remote[30]
    assert remote[30]["label"] == 30  # once shard 0 is idle, it gives way
    remote.close()


class _CountingLock:
    """A lock that counts the threads that reach it (under `state`, which it notifies), for the
    tests that stand in for a cache's ledger-opening lock."""

    def __init__(self, state: threading.Condition) -> None:
        self.state = state
        self.arrived = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self.state:
            self.arrived += 1
            self.state.notify_all()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_threads_that_ask_at_once_open_the_ledger_once(tmp_path, monkeypatch):
    """The sidecar fetch and prefetch threads may ask for the ledger first at the same moment:
    one of them opens it and reconciles the cache, the others wait and get the same ledger."""
    from shardloader.cache import store

    cache = store.ShardCache(tmp_path / "cache", 10**6)
    opened = []
    state = threading.Condition()
    opening_lock = _CountingLock(state)  # the cache's, counting the threads that reach it

    reconcile = store.reconcile

    def reconcile_watching_for_a_racer(layout, ledger):
        with state:
            opened.append(ledger)
            state.notify_all()
            # hold the first opening until every thread waits at the lock or another one
            # reconciles beside it (no lock); 60 s only bounds a broken run
            assert state.wait_for(lambda: opening_lock.arrived == 4 or len(opened) > 1, timeout=60)
        reconcile(layout, ledger)

    monkeypatch.setattr(cache, "_ledger_opening", opening_lock, raising=False)
    monkeypatch.setattr(store, "reconcile", reconcile_watching_for_a_racer)
    start = threading.Barrier(4)
    got = []

    def ask() -> None:
        start.wait()
        got.append(cache.ledger)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(opened) == 1
    assert len(got) == 4 and all(ledger is opened[0] for ledger in got)
    cache.close()


def test_close_while_a_thread_opens_the_ledger_closes_the_ledger_it_opened(tmp_path, monkeypatch):
    """`close()` called while another thread is opening the ledger (reconciling the cache)
    waits for that opening and closes what it opened: no ledger stays open behind a closed
    cache (before, close saw no ledger yet, and the opener then set one)."""
    from shardloader.cache import ledger as ledger_module
    from shardloader.cache import store

    connections_before = set(ledger_module._OPEN)  # this process's open ledger connections
    cache = store.ShardCache(tmp_path / "cache", 10**6)
    state = threading.Condition()
    opening_lock = _CountingLock(state)
    close_returned = threading.Event()
    reconcile = store.reconcile
    opened = []

    def reconcile_until_close_is_called(layout, ledger):
        # hold the opening until the closer waits at the lock (or, without the lock, has
        # returned); 60 s only bounds a broken run
        with state:
            opened.append(ledger)
            state.notify_all()
            assert state.wait_for(lambda: opening_lock.arrived == 2 or close_returned.is_set(),
                                  timeout=60)
        reconcile(layout, ledger)

    monkeypatch.setattr(cache, "_ledger_opening", opening_lock, raising=False)
    monkeypatch.setattr(store, "reconcile", reconcile_until_close_is_called)
    opener = threading.Thread(target=lambda: cache.ledger)
    opener.start()
    with state:
        assert state.wait_for(lambda: len(opened) == 1, timeout=60)

    def close() -> None:
        cache.close()
        with state:
            close_returned.set()
            state.notify_all()

    closer = threading.Thread(target=close)
    closer.start()
    opener.join(60)
    closer.join(60)
    assert not opener.is_alive() and not closer.is_alive()
    assert cache._ledger is None
    assert set(ledger_module._OPEN) == connections_before  # the opened ledger's connection: closed
