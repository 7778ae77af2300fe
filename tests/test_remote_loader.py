"""The Loader over s3:// (moto) and http:// datasets: exactly the batches of the same dataset read
locally, across resumes, cache limits, worker processes and injected network faults."""

from __future__ import annotations

import os

import pytest

from shardloader import Dataset, Loader
from shardloader.errors import FetchError
from shardloader.ingest.writer import write_shards
from tests.fixtures.servers import Fault, seeded
from tests.resume import assert_exact_resume, take
from tests.sample_transforms import make_samples, noisy_crop

BATCHES = 60  # one epoch is 51 batches: the runs cross an epoch boundary


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("remote-ds") / "ds")
    write_shards(make_samples(403), out, shard_samples=37)  # 11 shards
    return out


def loader(url, cache=None, *, limit="100MB", storage_options=None, max_open_shards=16, **kw):
    args = dict(batch_size=8, seed=5, transform=noisy_crop, partitions=4, window=2,
                shuffle=True, tail="pad")
    args.update(kw)
    args.setdefault("persistent_workers", args.get("num_workers", 0) > 0)  # DataLoader: needs workers
    ds = Dataset(url, cache_dir=None if cache is None else str(cache), cache_limit=limit,
                 storage_options=storage_options, max_open_shards=max_open_shards)
    return Loader(ds, **args)


@pytest.fixture(scope="module")
def reference(dataset_dir):
    """The batches of the local dataset: what every remote run must reproduce, bit for bit."""
    return take(loader(dataset_dir), BATCHES)


def test_exact_resume_over_s3(dataset_dir, reference, s3_server, s3_url, tmp_path):
    url = s3_url(dataset_dir)
    opts = s3_server.storage_options()
    make = lambda: loader(url, tmp_path / "cache", storage_options=opts)  # noqa: E731
    assert_exact_resume(make, BATCHES, [[7], [30, 51]], reference=reference)


def test_exact_resume_over_http_with_worker_processes(dataset_dir, reference, http_server, tmp_path):
    url = http_server(dataset_dir).url
    make = lambda: loader(url, tmp_path / "cache", num_workers=2)  # noqa: E731
    resumed = lambda _segment: loader(url, tmp_path / "cache", num_workers=1)  # noqa: E731
    assert_exact_resume(make, BATCHES, [[], [20]], make_resumed=resumed, reference=reference)


def test_a_small_cache_limit_changes_nothing_but_downloads(dataset_dir, reference, http_server, tmp_path):
    url = http_server(dataset_dir).url
    total = sum(os.path.getsize(os.path.join(dataset_dir, f)) for f in os.listdir(dataset_dir)
                if f.endswith(".arrow"))
    # Each batch reads from partitions x window = 8 shards; 4 open readers fit in 60%.
    small = loader(url, tmp_path / "small", limit=int(total * 0.6), max_open_shards=4)
    assert take(small, 25) == reference[:25]
    counters = small.dataset.source.counters()
    assert counters["evictions"] > 0  # the limit was in force
    small.close()


def test_an_epoch_with_faults_on_10_percent_of_requests_is_exact(dataset_dir, reference, s3_server,
                                                                 s3_url, fault_proxy, tmp_path):
    url = s3_url(dataset_dir)
    every_request = lambda method, path, headers: True  # noqa: E731 - index reads and HEADs too
    plan = seeded(0.10, 11, [Fault("status", status=503), Fault("status", status=500),
                             Fault("reset"), Fault("truncate", fraction=0.4)], match=every_request)
    proxy = fault_proxy(s3_server.endpoint, plan)
    opts = s3_server.storage_options(proxy.url)
    run = loader(url, tmp_path / "cache", storage_options=opts, num_workers=2)
    run.dataset.source.chunk_size = 1024  # ~40 range requests instead of 11
    assert take(run, BATCHES) == reference
    # The plan's seed puts faults on requests 3, 15, 17, 18 and 24 (whatever they carry).
    assert len(proxy.settled()) >= 25 and len(proxy.faults()) >= 5
    run.close()


def test_a_corrupt_remote_shard_fails_clearly_after_retries(dataset_dir, s3_server, s3_url, tmp_path):
    url = s3_url(dataset_dir)
    bucket, prefix = url[len("s3://"):].split("/", 1)
    data = bytearray(open(os.path.join(dataset_dir, "shard-00001.arrow"), "rb").read())
    data[len(data) // 2] ^= 0x04
    s3_server.put(bucket, f"{prefix}/shard-00001.arrow", bytes(data))
    ds = Dataset(url, cache_dir=str(tmp_path), cache_limit="100MB",
                 storage_options=s3_server.storage_options())
    ds.source.retry = ds.source.retry.__class__(base_delay=0.01, max_delay=0.05)
    assert len(ds.get_many(range(37))) == 37  # shard 0 is fine
    with pytest.raises(FetchError, match=rf"{url}/shard-00001.arrow: checksum mismatch after 3 downloads"):
        ds.get_many([40])
    assert os.listdir(tmp_path / "tmp") == []
    ds.close()


def test_a_missing_remote_shard_is_a_clear_error(dataset_dir, s3_server, s3_url, tmp_path):
    url = s3_url(dataset_dir)
    bucket, prefix = url[len("s3://"):].split("/", 1)
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/shard-00002.arrow")
    ds = Dataset(url, cache_dir=str(tmp_path), cache_limit="100MB",
                 storage_options=s3_server.storage_options())
    with pytest.raises(FetchError, match=rf"{url}/shard-00002.arrow: not found"):
        ds.get_many([80])


@pytest.mark.parametrize("workers,kind", [(0, "process"), (2, "process"), (2, "thread")])
def test_telemetry_counts_every_downloaded_byte_once(dataset_dir, http_server, tmp_path, workers, kind):
    """Prefetcher downloads (training process) and worker downloads add up to the dataset:
    one cold epoch downloads each shard once, and the per-batch records say so exactly."""
    url = http_server(dataset_dir).url
    total = sum(os.path.getsize(os.path.join(dataset_dir, f)) for f in os.listdir(dataset_dir)
                if f.endswith(".arrow"))
    cold = loader(url, tmp_path / "cache", num_workers=workers, worker_type=kind, tail="partial")
    batches = list(cold)
    stats = cold.stats()
    cold.close()
    assert len(batches) == len(cold)
    assert stats["bytes_downloaded"] == total
    assert stats["shard_wait_seconds_total"] <= stats["wall_seconds"] * max(1, workers)
