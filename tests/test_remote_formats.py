"""Every shard format read through the cache from an HTTP server: the bytes of the local dataset,
and a tar shard's offsets sidecar cached next to it (and evicted with it)."""

from __future__ import annotations

import os
import warnings

import pytest

from shardloader import Dataset
from shardloader.dataset.sharded import INDEX_FIELD
from tests.resume import assert_same_samples


@pytest.mark.parametrize("name", ["arrow_dataset", "tar_dataset", "parquet_dataset"])
def test_remote_reads_equal_the_samples(name, request, http_server, tmp_path):
    fixture = request.getfixturevalue(name)
    url = http_server(fixture.path).url
    ds = Dataset(url, cache_dir=str(tmp_path), cache_limit="50MB")
    order = [(i * 7) % len(fixture.samples) for i in range(len(fixture.samples))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tar sidecar that does not verify would warn
        got = ds.get_many(order)
    assert_same_samples(got, [fixture.samples[i] for i in order], name, skip=[INDEX_FIELD])
    ds.close()


def test_a_tar_sidecar_is_cached_with_its_shard_and_evicted_with_it(tar_dataset, http_server, tmp_path):
    url = http_server(tar_dataset.path).url
    shards = tar_dataset.index.shards
    assert all("offsets" in s.extra for s in shards)
    sidecar_bytes = shards[0].extra["offsets"]["bytes"]
    limit = shards[0].bytes + sidecar_bytes + shards[1].bytes // 2  # room for one shard
    ds = Dataset(url, cache_dir=str(tmp_path), cache_limit=limit, max_open_shards=1)
    ds.get_many([0])
    path = ds.source.store.path_for(shards[0])
    assert os.path.getsize(path + ".idx") == sidecar_bytes
    ds.close()  # (the Dataset opens a new reader before it closes its least recent one)
    ds.get_many([60])  # shard 1 needs the room: shard 0 and its sidecar go
    assert not os.path.exists(path) and not os.path.exists(path + ".idx")
    assert os.path.exists(ds.source.store.path_for(shards[1]) + ".idx")
    ds.close()
