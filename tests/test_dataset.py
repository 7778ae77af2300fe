"""Dataset: map-style access over every shard format, in this process and in workers."""

from __future__ import annotations

import multiprocessing
import pickle

import numpy as np
import pytest

from shardloader import Dataset
from shardloader.errors import ShardError
from tests.fixtures.data import copy_dataset


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "__index__"}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        np.array_equal(a[k], b[k]) if isinstance(b[k], np.ndarray) else a[k] == b[k] for k in b
    )


@pytest.mark.parametrize("name", ["arrow_dataset", "tar_dataset", "parquet_dataset"])
def test_len_getitem_get_many(request, name):
    fixture = request.getfixturevalue(name)
    ds = Dataset(fixture)
    n = len(fixture.samples)
    assert len(ds) == n
    assert _same(_strip(ds[-1]), fixture.samples[-1]) and ds[-1]["__index__"] == n - 1
    rng = np.random.default_rng(0)
    batch = rng.integers(0, n, size=64).tolist() + [0, n - 1, 0]
    got = ds.get_many(batch)
    assert [r["__index__"] for r in got] == batch
    assert all(_same(_strip(r), fixture.samples[i]) for r, i in zip(got, batch))
    with pytest.raises(IndexError):
        ds[n]
    ds.close()


def test_reader_lru_bound_keeps_results_exact(arrow_dataset):
    ds = Dataset(arrow_dataset, max_open_shards=1)
    order = [0, 199, 64, 1, 130, 199, 63]
    assert [r["name"] for r in ds.get_many(order)] == [arrow_dataset.samples[i]["name"] for i in order]
    assert len(ds._readers) == 1


def _worker_read(args):
    ds, rows = args
    return [(r["__index__"], r["data"]) for r in ds.get_many(rows)]


def test_pickles_into_worker_processes(tar_dataset):
    ds = Dataset(tar_dataset)
    ds[0]  # open a reader in the parent: it must not travel
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    jobs = [(ds, [5, 149, 60]), (ds, [100, 0])]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_worker_read, jobs)
    assert results == [[(i, tar_dataset.samples[i]["data"]) for i in rows] for _, rows in jobs]


def test_first_open_verifies_shard(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    with open(f"{root}/shard-00002.arrow", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    ds = Dataset(root)
    assert ds[0]["label"] == arrow_dataset.samples[0]["label"]
    with pytest.raises(ShardError, match="shard-00002.arrow: checksum"):
        ds.get_many([1, 130])
    unverified = Dataset(root, verify=False)  # the bytes changed, not the structure
    assert len(unverified.get_many([130])) == 1
