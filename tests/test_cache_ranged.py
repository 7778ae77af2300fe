"""Reads by byte range from a cold cache (shardloader.source.ranged), against real servers: rows
equal those of the whole shard bit for bit, the first batch does not wait for whole shards, the
cache still ends with whole verified shards, and a remote object that changed after indexing is
a clear error naming the shard, never wrong rows."""

from __future__ import annotations

import itertools
import json
import os
import re
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardloader import Dataset, Loader
from shardloader.cache.maintenance import verify_all
from shardloader.errors import ChecksumMismatch, FetchError
from shardloader.ingest.indexer import index_dataset
from shardloader.ingest.writer import write_shards
from tests.proctree import answer_from_fork
from tests.resume import assert_exact_resume, stream, take
from tests.sample_transforms import make_samples, noisy_crop

SAMPLES = [3, 200, 41, 42, 399, 0, 250, 41]  # several shards, repeats, both ends


def _write(path: str, fmt: str) -> str:
    if fmt == "parquet":
        os.makedirs(path)
        samples = list(make_samples(400))
        for s in range(4):
            part = samples[s * 100:(s + 1) * 100]
            table = pa.table({"data": [x["data"] for x in part], "label": [x["label"] for x in part]})
            pq.write_table(table, os.path.join(path, f"part-{s}.parquet"), row_group_size=10)
        index_dataset(path)
    else:
        write_shards(make_samples(400), path, shard_samples=50, format=fmt)
    return path


@pytest.fixture(scope="module", params=["arrow", "tar", "parquet"])
def dataset_dir(request, tmp_path_factory):
    return _write(str(tmp_path_factory.mktemp(f"ranged-{request.param}") / "ds"), request.param)


@pytest.fixture(scope="module")
def arrow_dir(tmp_path_factory):
    return _write(str(tmp_path_factory.mktemp("ranged-loader") / "ds"), "arrow")


def _ranged(ds: Dataset) -> Dataset:
    """`ds` reading by range as under a Loader, whose prefetcher downloads whole shards behind
    (a Dataset used alone reads whole shards)."""
    ds.source.expect_prefetch()
    return ds


def _cached_shards(cache: str) -> list[str]:
    out = []
    for root, _, files in os.walk(os.path.join(cache, "data")):
        out += [os.path.join(root, f) for f in files if not f.endswith((".idx", ".ranges", ".offsets"))]
    return out


def test_rows_by_range_equal_rows_of_the_local_shards(dataset_dir, s3_server, s3_url, tmp_path):
    want = Dataset(dataset_dir).get_many(SAMPLES)
    remote = _ranged(Dataset(s3_url(dataset_dir), cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                             storage_options=s3_server.storage_options()))
    got = remote.get_many(SAMPLES)
    assert got == want  # bytes, ints, keys: bit for bit, in the order asked
    counters = remote.source.counters()
    assert counters["range_reads"] >= 3 and counters["downloads"] == 0  # one read per shard
    assert _cached_shards(str(tmp_path / "cache")) == []  # nothing was downloaded whole
    assert [remote[i] for i in (41, 399)] == [want[2], want[4]]


def test_rows_by_range_over_http(arrow_dir, http_server, tmp_path):
    want = Dataset(arrow_dir).get_many(SAMPLES)
    remote = _ranged(Dataset(http_server(arrow_dir).url, cache_dir=str(tmp_path / "cache"), cache_limit="1GB"))
    assert remote.get_many(SAMPLES) == want
    assert remote.source.counters()["range_reads"] >= 4


def test_a_dataset_used_alone_reads_whole_shards(arrow_dir, s3_server, s3_url, tmp_path):
    remote = Dataset(s3_url(arrow_dir), cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                     storage_options=s3_server.storage_options())
    assert remote.get_many([3, 60]) == Dataset(arrow_dir).get_many([3, 60])
    counters = remote.source.counters()
    assert counters["range_reads"] == 0 and counters["downloads"] == 2


def _hold_whole_downloads(index, release: threading.Event, held: list[str]):
    """A proxy plan that holds every GET of a whole shard (what a whole-shard download asks
    for: bytes=0-(size-1)) until `release` is set; ranged reads of parts pass."""
    sizes = {info.path: info.bytes for info in index.shards}

    def plan(number, method, path, headers):
        name = path.split("?", 1)[0].rsplit("/", 1)[-1]
        wanted = headers.get("Range") or headers.get("range")
        if method == "GET" and name in sizes and wanted == f"bytes=0-{sizes[name] - 1}":
            held.append(name)
            release.wait(120)  # the test always sets it (in a finally); the bound is a safety net
        return None

    return plan


@pytest.mark.parametrize("workers", [0, 2])
def test_first_batch_completes_before_its_shards_are_downloaded(arrow_dir, s3_server, s3_url, fault_proxy,
                                                                 tmp_path, workers):
    def make(url, cache=None, opts=None):
        ds = Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=opts)
        return Loader(ds, batch_size=16, seed=3, shuffle=True, num_workers=workers, transform=noisy_crop,
                      partitions=4, window=2)

    reference = take(make(arrow_dir), 26)  # two epochs of 13 batches
    index = Dataset(arrow_dir).index
    release, held = threading.Event(), []
    proxy = fault_proxy(s3_server.endpoint, _hold_whole_downloads(index, release, held))
    cache = str(tmp_path / "cache")
    loader = make(s3_url(arrow_dir), cache, s3_server.storage_options(proxy.url))
    batches = stream(loader)
    try:
        first = list(itertools.islice(batches, 1))
        # The first batch is out while every whole-shard GET is held: it read its rows by range.
        assert not release.is_set() and _cached_shards(cache) == []
        assert first == reference[:1]
    finally:
        release.set()
    rest = list(itertools.islice(batches, 25))
    del batches
    loader.close()
    assert first + rest == reference
    assert held  # the prefetcher did ask for whole shards, and was held until released
    # The cache ends with whole, verified shards: every shard of the dataset.
    cached = _cached_shards(cache)
    assert len(cached) == index.num_shards
    results = list(verify_all(loader.dataset.source.store))  # the range sidecars read on the node too
    assert len([path for path, _, _ in results if not path.endswith(".ranges")]) == index.num_shards
    assert all(status == "ok" for _, status, _ in results)


def test_exact_resume_with_cold_caches(arrow_dir, s3_server, s3_url, tmp_path):
    url = s3_url(arrow_dir)
    opts = s3_server.storage_options()

    def make(segment: int = 0) -> Loader:  # every segment starts with an empty cache
        ds = Dataset(url, cache_dir=str(tmp_path / f"cache-{segment}-{len(os.listdir(tmp_path))}"),
                     cache_limit="1GB", storage_options=opts)
        return Loader(ds, batch_size=8, seed=5, shuffle=True, num_workers=2, transform=noisy_crop,
                      partitions=4, window=2, tail="pad", persistent_workers=True)

    local = lambda: Loader(Dataset(arrow_dir), batch_size=8, seed=5, shuffle=True,  # noqa: E731
                           transform=noisy_crop, partitions=4, window=2, tail="pad")
    reference = take(local(), 60)
    assert_exact_resume(make, 60, [[1], [3, 50]], make_resumed=make, reference=reference)


def _tamper(s3_server, url: str, name: str, lo: int, hi: int) -> None:
    """Rewrite object `name` under `url` with bytes [lo, hi) inverted (same size, new content)."""
    bucket, prefix = url[len("s3://"):].split("/", 1)
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read())
    data[lo:hi] = bytes(b ^ 0xFF for b in data[lo:hi])
    s3_server.put(bucket, f"{prefix}/{name}", bytes(data))


def test_an_object_changed_after_indexing_is_named_not_read(arrow_dir, s3_server, s3_url, tmp_path):
    url = s3_url(arrow_dir)
    index = Dataset(arrow_dir).index
    info = index.shards[1]
    _tamper(s3_server, url, info.path, info.bytes // 4, info.bytes * 3 // 4)
    remote = _ranged(Dataset(url, cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                             storage_options=s3_server.storage_options()))
    middle = [50 + 24, 50 + 25]  # rows in the middle of shard 1, inside the changed bytes
    with pytest.raises(ChecksumMismatch, match=rf"{url}/{info.path}: bytes \d+-\d+ read by range do "
                                               r"not match .*changed after indexing"):
        remote.get_many(middle)


def test_rows_read_by_range_are_verified_and_a_changed_shard_fails_loudly_later(
        arrow_dir, s3_server, s3_url, tmp_path):
    url = s3_url(arrow_dir)
    index = Dataset(arrow_dir).index
    info = index.shards[0]
    table_end = info.bytes - 64  # the footer: no row reads it, the whole file's checksum does
    _tamper(s3_server, url, info.path, table_end, table_end + 1)
    remote = _ranged(Dataset(url, cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                             storage_options=s3_server.storage_options()))
    remote.source.retry = type(remote.source.retry)(attempts=2, base_delay=0, checksum_attempts=1)
    # The footer is kept in the range sidecar, so the rows still verify against the index...
    assert remote.get_many([0, 1]) == Dataset(arrow_dir).get_many([0, 1])
    # ...and the whole shard, once fetched, fails its checksum with the URL named.
    with pytest.raises(FetchError, match=rf"{url}/{info.path}: checksum mismatch"):
        remote.source.local_path(info)


def test_a_changed_sidecar_means_reading_the_whole_shard(arrow_dir, s3_server, s3_url, tmp_path):
    url = s3_url(arrow_dir)
    index = Dataset(arrow_dir).index
    sidecar = index.shards[0].extra["ranges"]
    _tamper(s3_server, url, sidecar["path"], 100, 110)
    remote = _ranged(Dataset(url, cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                             storage_options=s3_server.storage_options()))
    with pytest.warns(UserWarning, match="sidecar does not match its index entry"):
        assert remote.get_many([0, 1]) == Dataset(arrow_dir).get_many([0, 1])
    assert remote.source.counters()["downloads"] == 1


def test_an_index_without_range_sidecars_reads_whole_shards(arrow_dir, s3_server, s3_bucket, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    data = json.loads(open(os.path.join(arrow_dir, "index.json")).read())
    for shard in data["shards"]:
        del shard["ranges"]  # as written before range sidecars existed
    (old / "index.json").write_text(json.dumps(data))
    for name in os.listdir(arrow_dir):
        if name.endswith(".arrow"):
            os.link(os.path.join(arrow_dir, name), old / name)
    url = s3_server.upload_dir(str(old), s3_bucket, "ds")
    remote = _ranged(Dataset(url, cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                             storage_options=s3_server.storage_options()))
    assert not remote.source.defers_prefetch(remote.index)
    assert remote.get_many(SAMPLES) == Dataset(arrow_dir).get_many(SAMPLES)
    counters = remote.source.counters()
    assert counters["range_reads"] == 0 and counters["downloads"] == len(set(np.asarray(SAMPLES) // 50))


def test_range_reads_stop_at_the_budget(arrow_dir, s3_server, s3_url, tmp_path):
    remote = _ranged(Dataset(s3_url(arrow_dir), cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                             storage_options=s3_server.storage_options()))
    remote.source.range_budget = 0.2
    want = Dataset(arrow_dir).get_many(range(50))
    got = [remote.get_many([i])[0] for i in range(50)]  # one shard, row after row
    assert got == want
    counters = remote.source.counters()
    assert 0 < counters["range_reads"] < 50 and counters["downloads"] == 1
    assert counters["range_bytes"] <= 0.2 * remote.index.shards[0].bytes + (64 << 10)  # + sidecars


def test_prefetch_waits_for_the_first_batch_only_when_it_reads_by_range(tmp_path):
    from shardloader.source.remote import RemoteSource

    arrow = write_shards(make_samples(20), tmp_path / "a", shard_samples=10)
    source = RemoteSource("s3://bucket/a", cache_dir=str(tmp_path / "cache"), cache_limit="1GB")
    assert source.defers_prefetch(arrow)
    source.range_reads = False
    assert not source.defers_prefetch(arrow)
    groups = _write(str(tmp_path / "p"), "parquet")  # 10 row groups per file: by range
    assert source.defers_prefetch(Dataset(groups).index) is False  # range reads are off
    source.range_reads = True
    assert source.defers_prefetch(Dataset(groups).index)
    pq.write_table(pa.table({"data": [b"x"] * 10, "label": list(range(10))}), tmp_path / "p" / "part-9.parquet")
    assert not source.defers_prefetch(index_dataset(str(tmp_path / "p")))  # one row group: whole


def _read_in_child(ds: Dataset, samples: list[int], conn) -> None:
    got = ds.get_many(samples)
    conn.send((got, ds.source.counters()["range_requests"], ds.source.counters()["downloads"]))


def test_primed_rows_are_read_by_a_forked_worker_without_a_request(arrow_dir, s3_server, s3_url, tmp_path):

    want = Dataset(arrow_dir).get_many(SAMPLES)
    remote = _ranged(Dataset(s3_url(arrow_dir), cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                             storage_options=s3_server.storage_options()))
    assert remote.prime(SAMPLES) > 0  # what a Loader does for its first batch, before forking
    primed = remote.source.counters()["range_requests"]
    assert primed > 0
    _, (got, requests, downloads) = answer_from_fork(_read_in_child, remote, SAMPLES, timeout=60)
    assert got == want  # bit for bit, in the order asked
    assert (requests, downloads) == (0, 0)  # every byte came with the fork, verified before it
    # and the training process itself reads them without a request too
    assert remote.get_many(SAMPLES) == want
    assert remote.source.counters()["range_requests"] == primed


def test_a_changed_object_is_refused_by_the_loaders_workers(arrow_dir, s3_server, s3_url, tmp_path):
    from shardloader.errors import ChecksumMismatch

    url = s3_url(arrow_dir)
    index = Dataset(arrow_dir).index
    for info in index.shards:  # every shard: whichever the first batch reads, it is changed
        _tamper(s3_server, url, info.path, info.bytes // 8, info.bytes * 7 // 8)
    ds = Dataset(url, cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                 storage_options=s3_server.storage_options())
    loader = Loader(ds, batch_size=16, seed=3, shuffle=True, num_workers=2, partitions=4, window=2)
    # the dataset's own error type, raised in the worker and rebuilt here with its traceback;
    # its first line (what a log line or an alert shows) names the shard and what is wrong
    with pytest.raises(ChecksumMismatch) as raised:
        take(loader, 1)
    first, rest = str(raised.value).split("\n", 1)
    assert re.fullmatch(rf"{re.escape(url)}/shard-\d+\.arrow: bytes \d+-\d+ read by range do not match "
                        r".*changed after indexing.* \(in shardloader worker process [01], batch 0 of "
                        r"epoch 0\)", first), first
    assert "Original Traceback (most recent call last):" in rest and "_fetch_spans" in rest
    loader.close()
    assert _cached_shards(str(tmp_path / "cache")) == []  # nothing unverified entered the cache


def test_the_first_batch_is_fetched_once_before_the_workers_start(arrow_dir, s3_server, s3_url, fault_proxy,
                                                                 tmp_path):
    url = s3_url(arrow_dir)
    proxy = fault_proxy(s3_server.endpoint)
    ds = Dataset(url, cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                 storage_options=s3_server.storage_options(proxy.url))
    loader = Loader(ds, batch_size=16, seed=3, shuffle=True, num_workers=2, transform=noisy_crop,
                    partitions=4, window=2)
    reference = Loader(Dataset(arrow_dir), batch_size=16, seed=3, shuffle=True, transform=noisy_crop,
                       partitions=4, window=2)
    assert take(loader, 3) == take(reference, 3)
    loader.close()
    shards, _ = ds.index.locate_many(loader.step_samples(0, 0))
    first = {ds.index.shards[s].path for s in np.unique(shards).tolist()}
    sidecar_gets = [entry.path.rsplit("/", 1)[-1] for entry in proxy.settled() if entry.path.endswith(".ranges")]
    # Each sidecar the first batch needs was fetched once, by the training process, and the
    # workers inherited it: none of them asked for it again.
    assert sorted(name for name in sidecar_gets if name[:-len(".ranges")] in first) == sorted(
        f"{path}.ranges" for path in first)


@pytest.mark.parametrize("worker_type", ["inline", "thread"])
def test_without_worker_processes_the_imports_are_done_while_the_first_batch_is_fetched(
        arrow_dir, s3_server, s3_url, tmp_path, monkeypatch, worker_type):
    """A cold Loader fetches its first batch's rows before its workers start; the producer's
    imports run during that wait also when no worker process will inherit them, so the first
    batch does not pay for them after it."""
    from shardloader.loader.batches import BatchProducer

    want = take(Loader(Dataset(arrow_dir), batch_size=16, seed=3, shuffle=True, partitions=4, window=2,
                       transform=noisy_crop), 2)
    events: list[str] = []
    warm_up, produce = BatchProducer.warm_up, BatchProducer.__call__

    def recording_warm_up(self):
        events.append("warm_up")
        warm_up(self)

    def recording_call(self, task):
        events.append("batch")
        return produce(self, task)

    monkeypatch.setattr(BatchProducer, "warm_up", recording_warm_up)
    monkeypatch.setattr(BatchProducer, "__call__", recording_call)
    ds = Dataset(s3_url(arrow_dir), cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                 storage_options=s3_server.storage_options())
    num_workers = 0 if worker_type == "inline" else 2
    kind = {} if worker_type == "inline" else {"worker_type": "thread"}
    loader = Loader(ds, batch_size=16, seed=3, shuffle=True, num_workers=num_workers, partitions=4,
                    window=2, transform=noisy_crop, **kind)
    assert take(loader, 2) == want
    loader.close()
    assert events[0] == "warm_up" and events.count("warm_up") == 1


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_slow_first_fetch_warns_with_what_happens_next(arrow_dir, s3_server, s3_url, fault_proxy, tmp_path,
                                                          monkeypatch, num_workers):
    """Past the wait for the first batch's bytes, the warning says what the loader does then:
    start its workers, or (without workers) read the first batch itself; either way the batch
    is the one a warm loader gives."""
    from shardloader.loader import prefetch_policy

    monkeypatch.setattr(prefetch_policy, "_PRIME_SECONDS", 0.01)
    proxy = fault_proxy(s3_server.endpoint, latency=0.3)
    ds = Dataset(s3_url(arrow_dir), cache_dir=str(tmp_path / "cache"), cache_limit="1GB",
                 storage_options=s3_server.storage_options(proxy.url))
    loader = Loader(ds, batch_size=16, seed=3, shuffle=True, num_workers=num_workers, partitions=4, window=2,
                    transform=noisy_crop)
    want = take(Loader(Dataset(arrow_dir), batch_size=16, seed=3, shuffle=True, partitions=4, window=2,
                       transform=noisy_crop), 1)
    then = "starting the workers anyway" if num_workers else "reading the first batch anyway"
    with pytest.warns(UserWarning, match=rf"^fetching the first batch's bytes took over 0.01 s; {then}"):
        assert take(loader, 1) == want
    loader.close()


def test_a_range_budget_takes_the_fewest_requests_that_fit_it():
    from shardloader.source.span_requests import coalesce, gaps_by_cost

    # spans (offset, length) of 10 bytes, 50, 200 and 1000 bytes apart, out of order
    spans = np.asarray([[1280, 10], [0, 10], [60, 10], [270, 10]], dtype=np.int64)
    options = list(gaps_by_cost(spans, max_gap=4096))
    assert options == [(4096, 1290), (1000, 1290), (200, 290), (50, 90), (0, 40)]
    for gap, cost in options:  # each figure is what the requests of that joining transfer
        assert cost == sum(hi - lo for lo, hi, _ in coalesce(spans, gap))
    budget = 300
    gap, cost = next((g, c) for g, c in options if c <= budget)
    assert (gap, len(coalesce(spans, gap))) == (200, 2)  # 2 requests, not the spans' 4


def test_a_read_that_asks_to_spend_after_its_shard_is_whole_spends_nothing(tmp_path):
    """The race that sent a node 1.253x a shard: a read found the shard missing, the download
    committed it and dropped its count, then the read asked to spend and counted from zero."""
    from shardloader.cache import range_spend
    from shardloader.cache.layout import CacheLayout

    layout = CacheLayout.create(tmp_path / "cache")
    name = "shard-" + "ab" * 16
    options = [("joined", 300), ("alone", 40)]
    assert range_spend.spend_first(layout, name, options, limit=320) == "joined"
    assert range_spend.spend_first(layout, name, options, limit=320) is None  # 300 + 40 > 320
    os.makedirs(os.path.dirname(layout.path_of(name)), exist_ok=True)
    open(layout.path_of(name), "wb").close()  # the download commits the shard...
    range_spend.forget(layout, name)  # ...and drops its count
    assert range_spend.spend_first(layout, name, options, limit=320) is None  # reads the cache
    os.unlink(layout.path_of(name))  # evicted: the next time it is missing, counting starts anew
    assert range_spend.spend_first(layout, name, options, limit=320) == "joined"
