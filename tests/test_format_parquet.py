"""Parquet shards read in place: rows equal pyarrow's own read, one and many row groups."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardloader import Dataset
from shardloader.errors import SchemaError, ShardError
from shardloader.format.parquet import ParquetShardReader
from shardloader.ingest.indexer import index_dataset
from tests.fixtures.data import copy_dataset


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "__index__"}


def test_rows_equal_pyarrow_read_many_row_groups(parquet_dataset):
    ds = Dataset(parquet_dataset)
    assert [s.extra["row_groups"] for s in ds.index.shards] == [4, 4, 4]
    expected = []
    for shard in ds.index.shards:
        expected += pq.read_table(os.path.join(parquet_dataset.path, shard.path)).to_pylist()
    assert len(expected) == len(ds) == 150
    assert [_strip(ds[i]) for i in range(len(ds))] == expected
    assert expected == parquet_dataset.samples
    rows = [149, 0, 31, 16, 15, 15, 100, 48]
    assert [_strip(r) for r in ds.get_many(rows)] == [expected[i] for i in rows]


def test_rows_equal_pyarrow_read_one_row_group(tmp_path):
    table = pa.table({
        "x": pa.array(np.arange(40, dtype=np.int32)),
        "y": pa.array([f"ü{i}" for i in range(40)]),
        "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(80, dtype=np.float32)), 2),
    })
    pq.write_table(table, tmp_path / "one.parquet")
    index = index_dataset(str(tmp_path))
    assert index.shards[0].extra["row_groups"] == 1
    assert dict(index.schema) == {"x": "int32", "y": "string", "v": "fixed_size_list<float32>[2]"}
    ds = Dataset(tmp_path)
    expected = table.to_pylist()
    for i in [39, 0, 17]:
        record = ds[i]
        assert record["x"] == expected[i]["x"] and record["y"] == expected[i]["y"]
        assert isinstance(record["v"], np.ndarray) and record["v"].tolist() == expected[i]["v"]


def test_row_group_cache_is_bounded(parquet_dataset):
    info = parquet_dataset.index.shards[0]
    path = os.path.join(parquet_dataset.path, info.path)
    rows = [0, 20, 40, 49, 1]
    small = ParquetShardReader(path, info, parquet_dataset.index.schema, cache_bytes=1)
    assert small.num_row_groups == 4
    large = ParquetShardReader(path, info, parquet_dataset.index.schema)
    for reader in (small, large):
        assert reader.read_rows(rows) == [parquet_dataset.samples[i] for i in rows]
        assert reader.read(1) == parquet_dataset.samples[1]
    assert list(small._cache) == [3, 0]  # the last two row groups touched, at least
    assert list(large._cache) == [1, 2, 3, 0]  # all four fit in the default budget
    small.close()
    large.close()


def test_corrupt_parquet_is_named(parquet_dataset, tmp_path):
    root = copy_dataset(parquet_dataset, tmp_path)
    info = parquet_dataset.index.shards[1]
    path = os.path.join(root, info.path)
    with open(path, "r+b") as f:
        f.seek(info.bytes - 4)
        f.write(b"XXXX")  # the trailing magic
    with pytest.raises(ShardError, match=rf"{path}: not a readable Parquet file"):
        ParquetShardReader(path, info)
    with pytest.raises(ShardError, match=rf"{path}: checksum"):
        Dataset(root)[60]


def test_count_and_schema_checked(parquet_dataset):
    info = parquet_dataset.index.shards[0]
    path = os.path.join(parquet_dataset.path, info.path)
    with pytest.raises(ShardError, match=r"holds 50 rows but the index records 51"):
        ParquetShardReader(path, dataclasses.replace(info, samples=51))
    with pytest.raises(SchemaError, match=rf"{info.path}: schema differs.*unexpected field 'name'"):
        ParquetShardReader(path, info, {"data": "binary", "label": "int64"})


def _with_nulls(parquet_dataset, tmp_path):
    """A copy of the Parquet dataset whose part-1 has a null `label` in row 5 and a null `name`
    in row 20 (second row group), indexed again."""
    root = copy_dataset(parquet_dataset, tmp_path)
    path = os.path.join(root, "part-1.parquet")
    table = pq.read_table(path)
    labels = table.column("label").to_pylist()
    names = table.column("name").to_pylist()
    labels[5], names[20] = None, None
    table = table.set_column(1, "label", pa.array(labels, pa.int64()))
    table = table.set_column(2, "name", pa.array(names, pa.string()))
    pq.write_table(table, path, row_group_size=16)
    index_dataset(root)
    return root, path


def test_null_values_are_an_error_naming_file_row_and_field(parquet_dataset, tmp_path):
    from shardloader import Loader

    root, path = _with_nulls(parquet_dataset, tmp_path)
    ds = Dataset(root)
    assert ds[54]["label"] == parquet_dataset.samples[54]["label"]  # other rows read as before
    with pytest.raises(SchemaError, match=rf"{path}: row 5: field 'label' is null"):
        ds[55]
    with pytest.raises(SchemaError, match=rf"{path}: row 20: field 'name' is null"):
        ds.get_many([0, 70, 1])
    loader = Loader(ds, batch_size=50, shuffle=False, tail="partial")
    batches = iter(loader)
    next(batches)  # part-0 has no nulls
    with pytest.raises(SchemaError, match=rf"{path}: row 5: field 'label' is null"):
        next(batches)  # not a TypeError from collate
    loader.close()


def test_verify_lists_fields_with_nulls(parquet_dataset, tmp_path):
    from shardloader.ingest.verify import verify_dataset

    root, path = _with_nulls(parquet_dataset, tmp_path)
    assert verify_dataset(root) == [
        f"{path}: null values in field 'label' (1), field 'name' (1); every field needs a value "
        "in every row (reading such a row is an error)"
    ]
    pq.write_table(pq.read_table(path), path, row_group_size=16, write_statistics=False)
    index_dataset(root)  # without statistics the columns are decoded to count
    assert verify_dataset(root)[0].startswith(f"{path}: null values in field 'label' (1), field 'name' (1)")
