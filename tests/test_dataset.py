"""Dataset: map-style access over every shard format, in this process and in workers."""

from __future__ import annotations

import multiprocessing
import pickle

import numpy as np
import pytest

from shardloader import Dataset
from shardloader.errors import ShardError
from tests.fixtures.data import copy_dataset
from tests.resume import assert_same_samples


@pytest.mark.parametrize("name", ["arrow_dataset", "tar_dataset", "parquet_dataset"])
def test_len_getitem_get_many(request, name):
    fixture = request.getfixturevalue(name)
    ds = Dataset(fixture)
    n = len(fixture.samples)
    assert len(ds) == n
    assert_same_samples([ds[-1]], [fixture.samples[-1]], "ds[-1]", skip=["__index__"])
    assert ds[-1]["__index__"] == n - 1
    rng = np.random.default_rng(0)
    batch = rng.integers(0, n, size=64).tolist() + [0, n - 1, 0]
    got = ds.get_many(batch)
    assert [r["__index__"] for r in got] == batch
    assert_same_samples(got, [fixture.samples[i] for i in batch], "get_many", skip=["__index__"])
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


# -- indexes that would silently lose data ------------------------------------------------------
def _set_samples(root: str, shard: int, samples: int) -> None:
    import json

    path = f"{root}/index.json"
    with open(path) as f:
        data = json.load(f)
    data["shards"][shard]["samples"] = samples
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.mark.parametrize("name,message", [
    ("arrow_dataset", r"shard-00001.arrow: shard holds 64 rows but the index records 0"),
    ("tar_dataset", r"shard-00001.tar: tar holds 50 samples but the index records 0"),
    ("parquet_dataset", r"part-1.parquet: shard holds 50 rows but the index records 0"),
])
def test_zero_samples_entry_for_a_shard_with_rows_is_an_error_at_open(request, tmp_path, name, message):
    root = copy_dataset(request.getfixturevalue(name), tmp_path)
    _set_samples(root, 1, 0)
    with pytest.raises(ShardError, match=message):
        Dataset(root)


def test_empty_shard_listed_as_empty_is_read_around(parquet_dataset, tmp_path):
    import pyarrow.parquet as pq

    from shardloader.ingest.indexer import index_dataset

    root = copy_dataset(parquet_dataset, tmp_path)
    table = pq.read_table(f"{root}/part-0.parquet")
    pq.write_table(table.slice(0, 0), f"{root}/part-0a.parquet")  # sorts between 0 and 1
    index_dataset(root)
    ds = Dataset(root)
    assert [s.samples for s in ds.index.shards] == [50, 0, 50, 50]
    assert [r["data"] for r in ds.get_many([49, 50, 149])] == [
        parquet_dataset.samples[i]["data"] for i in (49, 50, 149)]


def test_index_without_samples_is_an_error_not_zero_batches(parquet_dataset, tmp_path):
    import pyarrow.parquet as pq

    from shardloader.errors import DatasetIndexError
    from shardloader.ingest.indexer import index_dataset

    root = tmp_path / "empty"
    root.mkdir()
    table = pq.read_table(f"{parquet_dataset.path}/part-0.parquet")
    pq.write_table(table.slice(0, 0), root / "part-0.parquet")
    index_dataset(str(root))
    with pytest.raises(DatasetIndexError, match=rf"{root}: the index lists no samples \(1 shards"):
        Dataset(root)


def test_is_a_whole_loader_dataset(arrow_dataset):
    """A Dataset offers every member of the Loader's protocol itself: one missing would make the
    Loader read it through `CoreOnly`, whose null defaults would silently skip its cache
    priming, capacity check and reader closing."""
    from shardloader.loader.protocol import CoreOnly, LoaderDataset, as_native_dataset

    dataset = Dataset(arrow_dataset)
    assert isinstance(dataset, LoaderDataset)
    assert as_native_dataset(dataset) is dataset and not isinstance(as_native_dataset(dataset), CoreOnly)
