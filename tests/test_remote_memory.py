"""Downloaded bodies do not outlive their use in the training process.

Reading a dataset from S3, the training process downloads whole shards into the node cache
through `shardloader.io.s3client`, in chunks fetched concurrently by the client's threads.
Once a chunk is written to the cache file nothing may keep its response body: bodies kept
alive grow the training process with the dataset (issue 24: each idle client thread kept its
last future and so its last body; 176 MiB of bodies stayed alive after a 20k-image epoch).

The checks ask tracemalloc which blocks allocated under `s3client` are still alive (bytes
objects are neither gc-tracked nor weak-referenceable, so their allocation site is what
identifies them).
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections.abc import Iterator

import pytest

from shardloader import Dataset, Loader
from shardloader.ingest.writer import write_shards
from shardloader.io.clients import filesystem
from tests.fixtures.data import make_samples

MIB = 1 << 20
#: Live bytes allocated under s3client that a process may hold once no read is in progress:
#: half a body of the smallest requests below (`CHUNK`).
BOUND = 256 << 10
#: The download chunk of the epoch test: small shards still take several concurrent requests.
CHUNK = 512 << 10


# A forked worker process need not trace (its allocations are not what is checked; tracing
# them only slows the epoch down); stopping a tracemalloc that is off does nothing.
os.register_at_fork(after_in_child=tracemalloc.stop)


@pytest.fixture
def traced() -> Iterator[None]:
    """tracemalloc on, keeping the 5 innermost frames of each allocation: a body is allocated
    3 frames under s3client (`_request` -> `HTTPResponse.read` -> `_safe_read`)."""
    tracemalloc.start(5)
    try:
        yield
    finally:
        tracemalloc.stop()


def live_s3client_bytes() -> tuple[int, int]:
    """(bytes, blocks) still alive that were allocated with s3client.py on the stack."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*shardloader/io/s3client.py", all_frames=True)])
    traces = list(snapshot.traces)
    return sum(t.size for t in traces), len(traces)


def test_concurrent_range_bodies_are_freed_once_returned(s3_server, s3_bucket, traced):
    chunk, count = 2 * MIB, 8
    s3_server.put(s3_bucket, "blob", os.urandom(chunk * count))
    fs, path = filesystem(f"s3://{s3_bucket}/blob", s3_server.storage_options())
    for _ in range(2):  # the second round reuses the threads the first one started
        got = fs.cat_ranges([path] * count, [i * chunk for i in range(count)],
                            [(i + 1) * chunk for i in range(count)])
        assert [len(b) for b in got] == [chunk] * count
        del got
        held, blocks = live_s3client_bytes()
        assert held < BOUND, f"{blocks} blocks ({held / MIB:.1f} MiB) from s3client still alive"


def test_a_remote_epoch_leaves_no_body_in_the_training_process(s3_server, s3_url, tmp_path, traced):
    # Two shards of ~2 MiB, downloaded into the node cache by the training process in chunks
    # of CHUNK, `parallel_ranges` (4) at a time through the client's threads, while the workers
    # read rows by range.
    local = str(tmp_path / "ds")
    write_shards(make_samples(320, min_bytes=12_000, max_bytes=14_000), local, shard_samples=160)
    url = s3_url(local)
    ds = Dataset(url, cache_dir=str(tmp_path / "cache"), cache_limit="200MB",
                 storage_options=s3_server.storage_options())
    ds.source.chunk_size = CHUNK  # the default (8 MiB) would fetch these shards in one request
    loader = Loader(ds, batch_size=16, seed=1, num_workers=2, persistent_workers=True)
    try:
        assert sum(len(b["__index__"]) for b in loader) == 320
        for info in ds.index.shards:  # every download done (waits for any still running)
            ds.source.local_path(info)
            ds.source.release(info)
    finally:
        loader.close()
    held, blocks = live_s3client_bytes()
    assert held < BOUND, f"{blocks} blocks ({held / MIB:.1f} MiB) from s3client still alive"
