"""Background prefetch: never blocks the caller, follows the given order from the given position,
stays inside its window, yields to readers, stops cleanly, and reports rather than raises."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time

import pytest

from shardloader.errors import FetchError
from shardloader.format.index import ShardInfo
from shardloader.ingest.writer import write_shards
from shardloader.source.local import LocalSource
from shardloader.source.remote import RemoteSource

WAIT = 30.0


@pytest.fixture(scope="module")
def nine_shards(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pf") / "ds")
    samples = [{"data": hashlib.sha256(str(i).encode()).digest() * 60, "label": i} for i in range(180)]
    index = write_shards(samples, path, shard_samples=20)
    return path, index


@pytest.fixture
def served(nine_shards, http_server):
    return http_server(nine_shards[0])


def make_source(url, cache, **kw):
    kw.setdefault("cache_limit", "10MB")
    return RemoteSource(url, cache_dir=str(cache), **kw)


def present(src, infos):
    return [os.path.exists(src.store.path_for(i)) for i in infos]


def test_start_returns_at_once_and_the_order_is_consumed_in_the_background(nine_shards, served, tmp_path):
    _, index = nine_shards
    gate = threading.Event()

    def slow_order():  # an order computation that takes its time
        gate.wait(WAIT)
        yield from index.shards

    src = make_source(served.url, tmp_path, prefetch_shards=16)
    handle = src.start_prefetch(slow_order())
    assert handle.running and not gate.is_set()  # returned before the first shard was known
    gate.set()
    assert handle.wait(WAIT)
    assert present(src, index.shards) == [True] * 9
    assert handle.scheduled == [s.path for s in index.shards]
    assert src.counters()["prefetched"] == 9 and handle.errors == []
    handle.stop()


def _open_in_another_process(url, cache, index_json, shard):
    from shardloader.format.index import Index

    info = Index.loads(index_json).shards[shard]
    src = RemoteSource(url, cache_dir=cache, cache_limit="10MB")
    src.local_path(info)
    src.release(info)


def test_the_window_bounds_how_far_ahead_it_runs_and_reader_opens_slide_it(nine_shards, served, tmp_path):
    _, index = nine_shards
    pulled = []

    def order():
        for info in index.shards:
            pulled.append(info.path)
            yield info

    src = make_source(served.url, tmp_path, prefetch_shards=3)
    handle = src.start_prefetch(order())
    assert handle.wait_for(lambda h: h.stats["downloaded"] == 3, WAIT)
    assert handle.scheduled == [s.path for s in index.shards[:3]]
    assert len(pulled) <= 4  # the 4th waits for room; nothing further was asked for
    assert present(src, index.shards) == [True] * 3 + [False] * 6
    # A reader in this process opens shard 0: a cache hit, and the window moves by one.
    src.local_path(index.shards[0])
    assert handle.wait_for(lambda h: h.stats["downloaded"] == 4, WAIT)
    assert handle.scheduled == [s.path for s in index.shards[:4]]
    c = src.counters()
    assert (c["cache_hits"], c["cache_misses"]) == (1, 0)
    # A reader in another process (a worker) opens shard 2: shards 1 and 2 leave the window.
    proc = mp.get_context("spawn").Process(
        target=_open_in_another_process, args=(served.url, str(tmp_path), index.dumps(), 2))
    proc.start()
    proc.join(WAIT)
    assert proc.exitcode == 0
    assert handle.wait_for(lambda h: h.stats["downloaded"] == 6, WAIT)
    assert handle.scheduled == [s.path for s in index.shards[:6]]
    src.release(index.shards[0])
    handle.stop()


def test_after_resume_it_starts_at_the_resumed_position(nine_shards, served, tmp_path, fault_proxy):
    _, index = nine_shards
    proxy = fault_proxy(served.url)
    src = make_source(proxy.url, tmp_path, prefetch_concurrency=1, prefetch_shards=16)
    resumed = index.shards[5:] + index.shards[:2]  # the rest of the epoch, in order of need
    handle = src.start_prefetch(iter(resumed))
    assert handle.wait(WAIT)
    requested = [e.path.rsplit("/", 1)[-1] for e in proxy.settled()]
    assert requested == [s.path for s in resumed]


def test_stop_aborts_downloads_in_flight_and_commits_nothing_partial(nine_shards, served, tmp_path,
                                                                     fault_proxy):
    _, index = nine_shards
    proxy = fault_proxy(served.url, bandwidth=20_000)
    src = make_source(proxy.url, tmp_path, chunk_size="4KiB", parallel_ranges=1)
    handle = src.start_prefetch(iter(index.shards))
    assert proxy.wait_for_requests(3, WAIT)
    start = time.monotonic()
    handle.stop(timeout=20)
    assert time.monotonic() - start < 10
    assert not handle.running
    assert present(src, index.shards) == [False] * 9
    assert os.listdir(tmp_path / "tmp") == []
    assert handle.errors == []  # cancelling is not an error


def test_prefetched_shards_are_cache_hits_for_workers(nine_shards, served, tmp_path):
    _, index = nine_shards
    main = make_source(served.url, tmp_path, prefetch_shards=16)
    handle = main.start_prefetch(iter(index.shards))
    assert handle.wait(WAIT)
    worker = make_source(served.url, tmp_path)  # what a worker process holds
    for info in index.shards:
        worker.local_path(info)
        worker.release(info)
    w, m = worker.counters(), main.counters()
    assert (w["cache_hits"], w["cache_misses"], w["bytes_downloaded"]) == (9, 0, 0)
    assert (m["prefetched"], m["bytes_downloaded"]) == (9, index.total_bytes)


def test_a_failed_prefetch_is_recorded_and_the_reader_raises_clearly(nine_shards, served, tmp_path):
    _, index = nine_shards
    good = index.shards[0]
    missing = ShardInfo("gone/shard-x.arrow", "arrow", good.samples, good.bytes, good.checksum[:-1] + "0")
    src = make_source(served.url, tmp_path)
    handle = src.start_prefetch(iter([missing, index.shards[1]]))
    assert handle.wait(WAIT)
    assert len(handle.errors) == 1 and "gone/shard-x.arrow" in handle.errors[0]
    assert present(src, [index.shards[1]]) == [True]  # later shards still came
    with pytest.raises(FetchError, match=r"/gone/shard-x.arrow: not found"):
        src.local_path(missing)


def test_a_full_cache_makes_prefetch_wait_not_fail(nine_shards, served, tmp_path):
    _, index = nine_shards
    s = index.shards
    src = make_source(served.url, tmp_path, cache_limit=int(max(x.bytes for x in s) * 2.5))
    src.local_path(s[0])
    src.local_path(s[1])  # two pins: no room for anything else
    handle = src.start_prefetch(iter(s[2:4]))
    assert handle.wait_for(lambda h: h.stats["full_waits"] >= 1, WAIT)  # no room: it waits
    assert handle.stats["downloaded"] == 0 and handle.running and handle.errors == []
    src.release(s[0])
    assert handle.wait_for(lambda h: h.stats["downloaded"] >= 1, WAIT)
    assert present(src, s[:3]) == [False, True, True] and handle.errors == []
    src.release(s[1])
    handle.stop()


def test_a_local_source_has_nothing_to_prefetch(nine_shards):
    ds, index = nine_shards
    handle = LocalSource(ds).start_prefetch(iter(index.shards))
    assert not handle.running and handle.wait(0)
    handle.stop()


def test_prefetch_never_evicts_what_no_reader_opened_and_backs_off_while_a_reader_waits(
        nine_shards, served, tmp_path):
    from shardloader.errors import CacheFullError

    _, index = nine_shards
    s = index.shards
    biggest = max(x.bytes for x in s)
    src = make_source(served.url, tmp_path, cache_limit=int(biggest * 2.5))
    store = src.store
    fetch0, comp0 = src.plan(s[0])
    fetch1, comp1 = src.plan(s[1])
    fetch2, comp2 = src.plan(s[2])
    assert store.ensure(s[0], fetch0, comp0) == "downloaded"
    assert store.ensure(s[1], fetch1, comp1) == "downloaded"
    # Two unread prefetched shards fill the cache: a third prefetch is refused, evicting nothing.
    with pytest.raises(CacheFullError):
        store.ensure(s[2], fetch2, comp2)
    assert present(src, s[:3]) == [True, True, False]
    # Once shard 0 was read, it is what a prefetch may evict.
    src.local_path(s[0])
    src.release(s[0])
    assert store.ensure(s[2], fetch2, comp2) == "downloaded"
    assert present(src, s[:3]) == [False, True, True]
    # A reader waiting for room (the pressure signal is fresh) makes every prefetch back off.
    src.local_path(s[1])
    src.release(s[1])
    fetch3, comp3 = src.plan(s[3])
    store.pressure.raise_()  # fresh for RECENT_SECONDS (0.5 s): nothing else before the ensure
    with pytest.raises(CacheFullError, match="a reader is waiting for room"):
        store.ensure(s[3], fetch3, comp3)
    assert not present(src, [s[3]])[0]


def test_prefetch_leaves_the_readers_their_room(nine_shards, served, tmp_path):
    from shardloader.errors import CacheFullError

    _, index = nine_shards
    s = index.shards
    biggest = max(x.bytes for x in s)
    src = make_source(served.url, tmp_path, cache_limit=biggest * 3)
    store = src.store
    store.reader_reserve = biggest * 3  # e.g. three workers' shards: no room is the prefetch's
    fetch, comp = src.plan(s[0])
    with pytest.raises(CacheFullError):
        store.ensure(s[0], fetch, comp)
    store.reader_reserve = biggest * 2
    assert store.ensure(s[0], fetch, comp) == "downloaded"
