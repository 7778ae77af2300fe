"""`Dataset(url, source_options=...)`: the knobs of a remote dataset's reads (docs/cache.md,
"Knobs") reach them through the Dataset, the index read included; before, only `RemoteSource`
took them, so a Dataset user could not raise `chunk_size` (fewer requests per prefix) nor
change the backoff on `503 SlowDown` (docs/distributed.md)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from shardloader import Dataset
from shardloader.errors import FetchError
from shardloader.ingest.writer import write_shards
from shardloader.io.retry import RetryPolicy
from tests.fixtures.servers import Fault, always, first
from tests.sample_transforms import make_samples

SLOW_DOWN = Fault("status", status=503, body=b"<Error><Code>SlowDown</Code>"
                  b"<Message>Please reduce your request rate.</Message></Error>")


def _index_gets(method: str, path: str, headers: dict) -> bool:
    return method == "GET" and path.split("?")[0].endswith("/index.json")


def _first_gets_of_each_object(n: int, fault: Fault):
    """A plan: fault the first `n` GETs of each object."""
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def plan(number: int, method: str, path: str, headers: dict) -> Fault | None:
        if method != "GET":
            return None
        with lock:
            seen[path.split("?")[0]] += 1
            return fault if seen[path.split("?")[0]] <= n else None

    return plan


@pytest.fixture
def remote(tmp_path, s3_server):
    data = str(tmp_path / "ds")
    write_shards(make_samples(40), data, shard_samples=20)
    return s3_server.upload_dir(data, s3_server.create_bucket(), "ds")


def test_chunk_size_reaches_the_downloads(remote, s3_server, fault_proxy, tmp_path):
    proxy = fault_proxy(s3_server.endpoint)
    dataset = Dataset(remote, cache_dir=str(tmp_path / "cache"), cache_limit="10MB",
                      storage_options=s3_server.storage_options(endpoint=proxy.url),
                      source_options={"chunk_size": "512B", "parallel_ranges": 2})
    assert dataset[0]["label"] == 0
    shard = dataset.index.shards[0]
    ranges = [e.range for e in proxy.settled() if e.path.split("?")[0].endswith("/" + shard.path)]
    assert len(ranges) == -(-shard.bytes // 512) > 1, ranges  # 512-byte ranges, each once
    spans = sorted(tuple(map(int, r.removeprefix("bytes=").split("-"))) for r in ranges)
    assert all(hi - lo + 1 <= 512 for lo, hi in spans) and spans[-1][1] == shard.bytes - 1


def test_retry_reaches_the_index_read(remote, s3_server, fault_proxy, tmp_path):
    quick = {"base_delay": 0.01, "max_delay": 0.02}
    unavailable = Fault("status", status=503)  # no SlowDown code: a failure, which spends an attempt
    proxy = fault_proxy(s3_server.endpoint, plan=first(2, unavailable, match=_index_gets))
    options = s3_server.storage_options(endpoint=proxy.url)
    with pytest.raises(FetchError, match=r"index\.json: giving up after 2 failed attempts; last error: HTTP 503"):
        Dataset(remote, cache_dir=str(tmp_path / "cache"), storage_options=options,
                source_options={"retry": RetryPolicy(attempts=2, **quick)})
    proxy = fault_proxy(s3_server.endpoint, plan=first(2, unavailable, match=_index_gets))
    dataset = Dataset(remote, cache_dir=str(tmp_path / "cache"), storage_options=s3_server.storage_options(
        endpoint=proxy.url), source_options={"retry": RetryPolicy(attempts=3, **quick)})
    assert dataset.source.retry == RetryPolicy(attempts=3, **quick)
    assert [e.fault for e in proxy.settled() if _index_gets(e.method, e.path, {})] == ["status", "status", None]


def test_slow_down_answers_spend_no_attempt_and_the_deadline_bounds_them(remote, s3_server, fault_proxy,
                                                                         tmp_path):
    """S3's `503 SlowDown` paces its clients (for minutes while it partitions a prefix): it is
    retried with backoff past `attempts`, for the index and for shards, until the deadline."""
    policy = RetryPolicy(attempts=1, base_delay=0.005, max_delay=0.02)
    proxy = fault_proxy(s3_server.endpoint, plan=_first_gets_of_each_object(3, SLOW_DOWN))
    dataset = Dataset(remote, cache_dir=str(tmp_path / "cache"), cache_limit="10MB",
                      storage_options=s3_server.storage_options(endpoint=proxy.url), source_options={"retry": policy})
    assert dataset[25]["label"] == 25 % 7  # in the second shard
    gets: dict[str, list] = {}
    for e in proxy.settled():
        gets.setdefault(e.path.split("?")[0].rsplit("/", 1)[-1], []).append(e.fault)
    assert gets == {name: ["status"] * 3 + [None] for name in ("index.json", dataset.index.shards[1].path)}

    proxy = fault_proxy(s3_server.endpoint, plan=always(SLOW_DOWN))
    dataset = Dataset(remote, cache_dir=str(tmp_path / "cache2"), cache_limit="10MB",
                      storage_options=s3_server.storage_options(endpoint=proxy.url),
                      source_options={"retry": RetryPolicy(attempts=1, base_delay=0.01, max_delay=0.05,
                                                           deadline=0.5)})
    with pytest.raises(FetchError, match=r"shard-00000\.arrow: giving up after 0\.\d+ s \(deadline 0\.5 s, 0 "
                                         r"failed attempts and \d+ answers to slow down\); last error: HTTP 503 "
                                         r"\(.*SlowDown"):
        dataset[0]
    assert len(proxy.settled()) > 3


def test_source_options_refused_clearly(tmp_path, remote):
    local = str(tmp_path / "local")
    write_shards(make_samples(4), local)
    with pytest.raises(ValueError, match=r"^source_options: .* is a local dataset, read in place"):
        Dataset(local, source_options={"chunk_size": "1MiB"})
    with pytest.raises(ValueError, match=r"^source_options: unknown \['cache_dir', 'chunksize'\]"):
        Dataset(remote, source_options={"chunksize": "1MiB", "cache_dir": str(tmp_path)})
