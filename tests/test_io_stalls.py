"""A server that stops answering (the fault proxy holds every response past the read timeout):
every read of it gives up within `RetryPolicy.stall_limit(read timeout)` with a FetchError
naming the URL, however many retry loops the read goes through in turn (range sidecar, then
whole shard; prefetcher, then reader; parent, then forked worker). Before, each loop spent its
full budget: 134-194 s for a 5 s read timeout."""

from __future__ import annotations

import os
import random
import time

import aiohttp
import fsspec
import pytest

from shardloader import Dataset, Loader
from shardloader.errors import FetchError
from shardloader.ingest.writer import write_shards
from shardloader.io.checksum import checksum_bytes
from shardloader.io.clients import filesystem
from shardloader.io.retry import RetryPolicy, StallClock
from shardloader.io.transfer import RangeRequest, download, read_ranges
from tests.sample_transforms import make_samples

READ_TIMEOUT = 2.0
POLICY = RetryPolicy(attempts=5, base_delay=0.2, max_delay=1.0, deadline=600)
HELD = 60.0  # seconds the proxy holds each response: far past the read timeout
SLACK = 4.0  # for a busy 2-core machine: worker start, error hand-over
BOUND = 5 * READ_TIMEOUT + 0.2 + 0.4 + 0.8 + 1.0  # attempts x read timeout + backoff: 12.4 s


def test_the_stated_bound():
    # Defaults, 5 s read timeout: 10 attempts x 5 s + backoff 0.2+0.4+...+10 = 92.6 s.
    assert RetryPolicy().stall_limit(5.0) == pytest.approx(92.6)
    assert RetryPolicy().stall_limit(60.0) == 600.0  # the deadline caps it
    assert POLICY.stall_limit(READ_TIMEOUT) == pytest.approx(BOUND)


def test_the_stall_clock_ends_with_any_answer_and_after_a_pause():
    clock, url = StallClock(), "s3://bucket/ds/shard.arrow"
    once = RetryPolicy(attempts=1, base_delay=0.0)  # the bound is one read timeout
    clock.record(url, time.monotonic() - 3.0, answered=False, timed_out=True)  # took 3 s
    with pytest.raises(FetchError, match=rf"{url}: giving up: s3://bucket has not answered for "
                                         r"3\.0 s \(1 requests in a row timed out"):
        clock.check([url], once)
    clock.check(["s3://other/x", "/local/file"], once)  # other endpoints, local files: no stall
    clock.record("s3://bucket/other", time.monotonic(), answered=True, timed_out=False)
    clock.check([url], once)  # an answer (data or an HTTP status) ended the stall
    clock.record(url, time.monotonic() - 3.0, answered=False, timed_out=True)
    since, last, took, count = clock._runs["s3://bucket"]
    clock._runs["s3://bucket"] = (since - 100, last - 100, took, count)  # nobody retried since
    clock.check([url], once)  # a stall nobody retried for a while is over: a new read starts anew


def _download(fs, path, url, tmp_path, payload):
    fd = os.open(tmp_path / "out.part", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        return download(fs, path, url, fd, size=len(payload), checksum=checksum_bytes(payload),
                        policy=POLICY, chunk_size=64 << 10, parallel=2)
    finally:
        os.close(fd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_fallback_after_a_stalled_read_does_not_start_a_new_budget(store, s3_server, s3_bucket,
                                                                    http_server, fault_proxy,
                                                                    tmp_path):
    payload = random.Random(3).randbytes(200_000)
    if store == "s3":  # the botocore S3 reader, its read_timeout
        s3_server.put(s3_bucket, "ds/shard.arrow", payload)
        s3_server.put(s3_bucket, "ds/shard.arrow.ranges", payload[:5000])
        proxy = fault_proxy(s3_server.endpoint)
        root, endpoint = f"s3://{s3_bucket}/ds", f"s3://{s3_bucket}"
        fs, _ = filesystem(root, s3_server.storage_options(proxy.url, timeout=READ_TIMEOUT))
        base = f"{s3_bucket}/ds"
    else:  # fsspec's http filesystem (aiohttp), its sock_read timeout
        (tmp_path / "shard.arrow").write_bytes(payload)
        (tmp_path / "shard.arrow.ranges").write_bytes(payload[:5000])
        proxy = fault_proxy(http_server(str(tmp_path)).url)
        root = endpoint = proxy.url
        fs, _ = fsspec.core.url_to_fs(root, client_kwargs={
            "timeout": aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT)})
        base = root
    sidecar, shard = f"{root}/shard.arrow.ranges", f"{root}/shard.arrow"
    proxy.latency = HELD
    start = time.monotonic()
    with pytest.raises(FetchError, match=f"{sidecar}: giving up"):
        read_ranges(fs, [RangeRequest(f"{base}/shard.arrow.ranges", sidecar, 0, 5000, 5000)],
                    policy=POLICY)
    # What the range reader does next: the whole shard, from the same stalled server.
    with pytest.raises(FetchError, match=f"{shard}: giving up: {endpoint} has not answered"):
        _download(fs, f"{base}/shard.arrow", shard, tmp_path, payload)
    elapsed = time.monotonic() - start
    assert elapsed < BOUND + SLACK, f"took {elapsed:.1f} s"  # before: two budgets, 2 x BOUND


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("stall-ds") / "ds")
    write_shards(make_samples(100), out, shard_samples=25)  # 4 shards, with range sidecars
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_over_a_stalled_s3_server_fails_within_the_bound(small_dataset, s3_server, s3_url,
                                                                 fault_proxy, tmp_path, workers):
    url = s3_url(small_dataset)
    proxy = fault_proxy(s3_server.endpoint)
    ds = Dataset(url, cache_dir=str(tmp_path / "cache"),
                 storage_options=s3_server.storage_options(proxy.url, timeout=READ_TIMEOUT))
    ds.source.retry = POLICY
    loader = Loader(ds, batch_size=8, seed=1, num_workers=workers,
                    persistent_workers=workers > 0)
    proxy.latency = HELD  # the index is read; from now on nothing is answered
    start = time.monotonic()
    try:
        with pytest.raises(FetchError) as raised:
            next(iter(loader))
    finally:
        elapsed = time.monotonic() - start
        loader.close()
    assert f"{url}/shard-" in str(raised.value) and "giving up" in str(raised.value)
    # Before: the sidecar's budget, then the whole shard's (then, with workers, a worker's own).
    assert elapsed < BOUND + SLACK, f"took {elapsed:.1f} s"
