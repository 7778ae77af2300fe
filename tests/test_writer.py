"""write_shards: schema inference and checks, shard limits, atomic output, failures."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardloader import Dataset, write_shards
from shardloader.errors import SchemaError, ShardloaderError
from shardloader.format.index import INDEX_NAME


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "__index__"}


def test_schema_inferred_from_first_sample(tmp_path):
    sample = {
        "b": b"x", "m": memoryview(b"mv"), "i": 3, "f": 0.5, "s": "é", "t": True,
        "a": np.zeros((2, 3), dtype=np.uint8), "n": np.float32(1.5),
    }
    index = write_shards([sample], tmp_path / "ds")
    assert dict(index.schema) == {
        "b": "binary", "m": "binary", "i": "int64", "f": "float64", "s": "string", "t": "bool",
        "a": "array<uint8>[2,3]", "n": "float32",
    }
    record = Dataset(tmp_path / "ds")[0]
    assert record["m"] == b"mv" and record["t"] is True and record["n"] == 1.5
    assert record["a"].dtype == np.uint8 and record["a"].shape == (2, 3)


@pytest.mark.parametrize("later,message", [
    ({"x": 1, "y": "a", "z": 0}, r"sample 2: fields differ from the schema \(missing \[\], unexpected \['z'\]\)"),
    ({"x": 1}, r"sample 2: fields differ from the schema \(missing \['y'\]"),
    ({"x": "one", "y": "a"}, r"sample 2: field 'x' holds a value of type string, but the schema type is int64"),
    ({"x": 1.5, "y": "a"}, r"sample 2: field 'x' holds a value of type float64, but the schema type is int64"),
    ({"x": 1, "y": None}, r"sample 2: field 'y' holds an unstorable value \(None values"),
    ({"x": 1, "y": ["a"]}, r"sample 2: field 'y' holds an unstorable value \(values of type list"),
])
def test_later_sample_that_differs_is_named(tmp_path, later, message):
    samples = [{"x": 0, "y": "a"}, {"x": 1, "y": "b"}, later]
    with pytest.raises(SchemaError, match=message):
        write_shards(samples, tmp_path / "ds")
    assert not os.path.exists(tmp_path / "ds" / INDEX_NAME)
    assert os.listdir(tmp_path / "ds") == []  # no shard or temp file left behind


def test_array_shape_and_dtype_must_match(tmp_path):
    samples = [{"a": np.zeros(3, np.float32)}, {"a": np.zeros(4, np.float32)}]
    with pytest.raises(SchemaError, match=r"sample 1: field 'a' holds a value of type array<float32>\[4\], but the schema type is array<float32>\[3\]"):
        write_shards(samples, tmp_path / "ds")
    with pytest.raises(SchemaError, match=r"sample 0: field 'a': numpy arrays of dtype bool"):
        write_shards([{"a": np.zeros(3, bool)}], tmp_path / "ds")
    with pytest.raises(SchemaError, match=r"sample 0: field 'a': 0-d numpy arrays"):
        write_shards([{"a": np.array(1.0)}], tmp_path / "ds")


def test_ints_fit_float_fields_and_explicit_schema(tmp_path):
    index = write_shards([{"v": 1.5}, {"v": 2}], tmp_path / "a")
    assert [r["v"] for r in Dataset(tmp_path / "a").get_many([0, 1])] == [1.5, 2.0]
    schema = {"v": "float32", "k": "int8"}
    index = write_shards([{"v": 1, "k": 127}], tmp_path / "b", schema=schema)
    assert dict(index.schema) == schema
    with pytest.raises(SchemaError, match=r"sample 0: field 'k' holds a value of type int64, but the schema type is int8"):
        write_shards([{"v": 1, "k": 128}], tmp_path / "c", schema=schema)
    with pytest.raises(SchemaError, match="field 'v': type 'complex' cannot be written"):
        write_shards([{"v": 1}], tmp_path / "d", schema={"v": "complex"})


def test_shard_limits(tmp_path):
    samples = [{"d": bytes(100)} for _ in range(10)]
    index = write_shards(samples, tmp_path / "by-count", shard_samples=4)
    assert [s.samples for s in index.shards] == [4, 4, 2]
    index = write_shards(samples, tmp_path / "by-bytes", shard_bytes=350)
    assert [s.samples for s in index.shards] == [3, 3, 3, 1]


@pytest.mark.parametrize("fmt", ["arrow", "tar"])
def test_sample_larger_than_limit_gets_own_shard(tmp_path, fmt):
    samples = [{"d": bytes([i]) * 10} for i in range(3)]
    samples.insert(1, {"d": b"B" * 5000})
    index = write_shards(samples, tmp_path / "ds", shard_bytes=100, format=fmt)
    assert [s.samples for s in index.shards] == [1, 1, 2]
    ds = Dataset(tmp_path / "ds")
    assert [r["d"] for r in ds.get_many(range(4))] == [s["d"] for s in samples]


def test_empty_input_is_an_error(tmp_path):
    with pytest.raises(ShardloaderError, match=r"ds: no samples to write \(the input is empty\)"):
        write_shards(iter([]), tmp_path / "ds")
    assert not os.path.exists(tmp_path / "ds" / INDEX_NAME)


def test_unicode_keys_and_values(tmp_path):
    samples = [{"名前": f"値-{i}-ß", "données": "é".encode() * i} for i in range(5)]
    index = write_shards(samples, tmp_path / "ds", shard_samples=2)
    assert dict(index.schema) == {"名前": "string", "données": "binary"}
    ds = Dataset(tmp_path / "ds")
    assert [_strip(ds[i]) for i in range(5)] == samples


def test_meta_fields_dropped_key_kept(tmp_path):
    samples = [{"__key__": f"k{i}", "__url__": "x", "__index__": i, "v": i} for i in range(3)]
    index = write_shards(samples, tmp_path / "ds")
    assert dict(index.schema) == {"__key__": "string", "v": "int64"}
    assert [_strip(r) for r in Dataset(tmp_path / "ds").get_many([2, 0])] == [
        {"__key__": "k2", "v": 2}, {"__key__": "k0", "v": 0},
    ]


def test_tar_keys_default_to_zero_padded_position(tmp_path):
    index = write_shards([{"v": i, "s": f"{i}"} for i in range(12)], tmp_path / "ds",
                         format="tar", shard_samples=5)
    assert dict(index.schema) == {"v": "binary", "s": "binary"}
    ds = Dataset(tmp_path / "ds")
    assert [r["__key__"] for r in ds.get_many(range(12))] == [f"{i:09d}" for i in range(12)]
    assert ds[7]["v"] == b"7"


def test_refuses_existing_dataset_unless_overwrite(tmp_path):
    write_shards([{"v": 1}], tmp_path / "ds")
    with pytest.raises(ShardloaderError, match=r"index.json: the output directory already holds a dataset"):
        write_shards([{"v": 2}], tmp_path / "ds")
    write_shards([{"v": 3}], tmp_path / "ds", overwrite=True)
    assert Dataset(tmp_path / "ds")[0]["v"] == 3


def test_output_files_are_final_names_only(tmp_path):
    write_shards([{"d": bytes(50)} for _ in range(20)], tmp_path / "ds", shard_samples=8, format="tar")
    assert sorted(os.listdir(tmp_path / "ds")) == [
        "index.json", "shard-00000.tar", "shard-00000.tar.idx", "shard-00000.tar.ranges",
        "shard-00001.tar", "shard-00001.tar.idx", "shard-00001.tar.ranges",
        "shard-00002.tar", "shard-00002.tar.idx", "shard-00002.tar.ranges",
    ]


def test_failure_midway_removes_written_shards(tmp_path):
    def samples():
        for i in range(10):
            yield {"v": i}
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_shards(samples(), tmp_path / "ds", shard_samples=3)
    assert os.listdir(tmp_path / "ds") == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=40),
    shard_bytes=st.integers(min_value=1, max_value=1000),
    shard_samples=st.one_of(st.none(), st.integers(min_value=1, max_value=12)),
    fmt=st.sampled_from(["arrow", "tar"]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_property_write_index_read(sizes, shard_bytes, shard_samples, fmt, seed):
    rng = np.random.default_rng(seed)
    samples = [{"d": rng.bytes(n), "i": i} for i, n in enumerate(sizes)]
    with tempfile.TemporaryDirectory() as tmp:
        index = write_shards(samples, tmp, shard_bytes=shard_bytes, shard_samples=shard_samples,
                             format=fmt)
        counts = [s.samples for s in index.shards]
        assert sum(counts) == index.num_samples == len(samples)
        assert all(c >= 1 for c in counts)
        if shard_samples is not None:
            assert max(counts) <= shard_samples
        start = 0
        for count in counts:  # each shard within the byte limit, or a single sample
            payload = sum(sizes[start:start + count]) + 8 * count
            assert count == 1 or payload <= shard_bytes
            start += count
        ds = Dataset(tmp)
        order = rng.permutation(len(samples)).tolist()
        got = ds.get_many(order)
        assert [r["d"] for r in got] == [samples[i]["d"] for i in order]
        expected_i = [samples[i]["i"] for i in order]
        assert [int(r["i"]) for r in got] == expected_i
        assert [ds.index.locate(i) for i in order] == [
            tuple(x) for x in zip(*[a.tolist() for a in ds.index.locate_many(order)])
        ]
        ds.close()
