"""Retrying downloads against a real HTTP server and S3 server, with faults injected by a proxy."""

from __future__ import annotations

import os
import random
import threading

import fsspec
import pytest

from shardloader.errors import FetchError
from shardloader.io.checksum import checksum_bytes
from shardloader.io.retry import FetchCancelled, RetryPolicy
from shardloader.io.transfer import download, read_bytes
from tests.fixtures.servers import Fault, always, every, first, seeded

FAST = RetryPolicy(attempts=6, base_delay=0.005, max_delay=0.02, deadline=30)
PAYLOAD = random.Random(7).randbytes(300_000)


@pytest.fixture
def served(tmp_path, http_server):
    (tmp_path / "blob.bin").write_bytes(PAYLOAD)
    return http_server(str(tmp_path))


def fetch(url, tmp_path, *, payload=PAYLOAD, policy=FAST, cancel=None, chunk=64 << 10,
          storage_options=None):
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fd = os.open(tmp_path / "out.part", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        stats = download(fs, path, url, fd, size=len(payload), checksum=checksum_bytes(payload),
                         policy=policy, chunk_size=chunk, parallel=3, cancel=cancel)
    finally:
        os.close(fd)
    return stats, (tmp_path / "out.part").read_bytes()


def test_clean_download_is_exact_and_ranged(served, tmp_path, fault_proxy):
    proxy = fault_proxy(served.url)
    stats, data = fetch(proxy.url + "/blob.bin", tmp_path)
    proxy.settled()
    assert data == PAYLOAD
    assert stats.retries == 0 and stats.bytes_received == len(PAYLOAD)
    assert len(proxy.log) == 5  # ceil(300000 / 65536) range requests
    assert all(entry.range for entry in proxy.log)


@pytest.mark.parametrize("fault", [
    Fault("status", status=503), Fault("status", status=500), Fault("status", status=429),
    Fault("reset"), Fault("truncate", fraction=0.3), Fault("corrupt"),
])
def test_transient_faults_are_retried_to_the_exact_bytes(served, tmp_path, fault_proxy, fault):
    # A corrupt body is only caught by the whole-object checksum: corrupt once, not every 2nd.
    plan = first(1, fault) if fault.kind == "corrupt" else every(2, fault)
    proxy = fault_proxy(served.url, plan)
    stats, data = fetch(proxy.url + "/blob.bin", tmp_path)
    proxy.settled()
    assert data == PAYLOAD
    assert proxy.faults(), "the plan injected no fault"
    if fault.kind == "corrupt":  # a 200 that lies: only the checksum catches it
        assert stats.checksum_failures >= 1
    else:
        assert stats.retries >= 1


def test_ranges_already_written_are_kept_across_retries(served, tmp_path, fault_proxy):
    # The 5th range request fails once: only that range is fetched again.
    proxy = fault_proxy(served.url, lambda n, m, p, h: Fault("status", status=503) if n == 4 else None)
    stats, data = fetch(proxy.url + "/blob.bin", tmp_path)
    proxy.settled()
    assert data == PAYLOAD and stats.retries == 1
    failed = [e.range for e in proxy.log if e.fault]
    ranges = [e.range for e in proxy.log]
    assert len(failed) == 1 and len(ranges) == 6
    assert ranges.count(failed[0]) == 2 and len(set(ranges)) == 5


def test_404_is_permanent_and_names_the_url(served, tmp_path, fault_proxy):
    proxy = fault_proxy(served.url)
    url = proxy.url + "/missing.bin"
    with pytest.raises(FetchError, match="missing.bin: not found"):
        fetch(url, tmp_path)
    proxy.settled()
    assert len(proxy.log) <= 3  # one round of parallel ranges, no retry


def test_403_is_permanent(served, tmp_path, fault_proxy):
    proxy = fault_proxy(served.url, always(Fault("status", status=403)))
    with pytest.raises(FetchError, match=r"blob.bin: access denied \(HTTP 403"):
        fetch(proxy.url + "/blob.bin", tmp_path)
    proxy.settled()
    assert len(proxy.log) <= 3


def test_persistent_5xx_gives_up_after_the_attempt_bound(served, tmp_path, fault_proxy):
    proxy = fault_proxy(served.url, always(Fault("status", status=503)))
    policy = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.002)
    with pytest.raises(FetchError, match=r"blob.bin: giving up after 3 failed attempts; last error: HTTP 503"):
        fetch(proxy.url + "/blob.bin", tmp_path, policy=policy, chunk=1 << 20)
    proxy.settled()
    assert len(proxy.log) == 3


def test_deadline_bounds_the_total_time(served, tmp_path, fault_proxy):
    proxy = fault_proxy(served.url, always(Fault("status", status=503)))
    policy = RetryPolicy(attempts=1000, base_delay=0.05, max_delay=0.05, deadline=0.3)
    with pytest.raises(FetchError, match=r"deadline 0.3 s"):
        fetch(proxy.url + "/blob.bin", tmp_path, policy=policy, chunk=1 << 20)
    proxy.settled()
    assert len(proxy.log) < 12


def test_corrupt_remote_object_fails_clearly_after_retries(served, tmp_path, fault_proxy):
    proxy = fault_proxy(served.url, always(Fault("corrupt")))
    with pytest.raises(FetchError, match=r"blob.bin: checksum mismatch after 3 downloads"):
        fetch(proxy.url + "/blob.bin", tmp_path, chunk=1 << 20)
    proxy.settled()
    assert len(proxy.log) == 3


def test_object_shorter_than_the_index_is_permanent(served, tmp_path, fault_proxy):
    proxy = fault_proxy(served.url)
    longer = PAYLOAD + b"extra bytes the server does not have" * 3000
    with pytest.raises(FetchError, match="shorter than the .* bytes the index records"):
        fetch(proxy.url + "/blob.bin", tmp_path, payload=longer)


def test_cancel_stops_between_ranges(served, tmp_path, fault_proxy):
    cancel = threading.Event()
    # Every request is slowed down; the first one to arrive cancels the download.
    proxy = fault_proxy(served.url, latency=0.05)
    proxy.plan = lambda n, m, p, h: cancel.set()
    with pytest.raises(FetchCancelled):
        fetch(proxy.url + "/blob.bin", tmp_path, cancel=cancel, chunk=16 << 10)
    proxy.settled()
    assert len(proxy.log) <= 3


def test_s3_with_seeded_faults(s3_server, s3_bucket, fault_proxy, tmp_path):
    s3_server.put(s3_bucket, "obj/blob.bin", PAYLOAD)
    proxy = fault_proxy(s3_server.endpoint, seeded(0.3, 3, [
        Fault("status", status=503), Fault("reset"), Fault("truncate"), Fault("status", status=500),
    ]))
    stats, data = fetch(f"s3://{s3_bucket}/obj/blob.bin", tmp_path,
                        storage_options=s3_server.storage_options(proxy.url))
    proxy.settled()
    assert data == PAYLOAD
    assert proxy.faults()


def test_s3_missing_object_and_denied(s3_server, s3_bucket, fault_proxy, tmp_path):
    opts = s3_server.storage_options()
    with pytest.raises(FetchError, match=rf"s3://{s3_bucket}/nope.bin: not found"):
        fetch(f"s3://{s3_bucket}/nope.bin", tmp_path, storage_options=opts)
    s3_server.put(s3_bucket, "blob.bin", PAYLOAD)
    proxy = fault_proxy(s3_server.endpoint, always(Fault("status", status=403)))
    with pytest.raises(FetchError, match="access denied"):
        fetch(f"s3://{s3_bucket}/blob.bin", tmp_path, storage_options=s3_server.storage_options(proxy.url))


def test_read_bytes_retries_transient_errors(served, fault_proxy):
    match_all = lambda m, p, h: True  # noqa: E731
    proxy = fault_proxy(served.url, first(2, Fault("status", status=502), match=match_all))
    assert read_bytes(proxy.url + "/blob.bin", policy=FAST) == PAYLOAD
    proxy.settled()
    assert [e.fault for e in proxy.log] == ["status", "status", None]
    with pytest.raises(FileNotFoundError):
        read_bytes(proxy.url + "/none.json", policy=FAST)


def test_backoff_is_exponential_with_jitter_and_capped():
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    rng = random.Random(0)
    for retry, ceiling in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (30, 1.0)]:
        draws = [policy.backoff(retry, rng) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in draws)
        assert len(set(draws)) > 1  # jittered
