"""Arrow IPC files read without pyarrow: the same values as pyarrow's reader, pyarrow for what
it does not read, no exception on damaged files, and no pyarrow in a loader's processes."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from shardloader import write_shards
from shardloader.format import ipc
from shardloader.format.arrow import ArrowShardReader
from shardloader.format.schema import BatchRows, schema_names
from shardloader.ingest import writer
from tests.fixtures.data import make_samples
from tests.resume import assert_same_samples

_NUMBERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float16", "float32", "float64")


def _every_type_samples(n: int) -> list[dict]:
    """Samples with a field of every type `ipc` reads (numbers at their range's ends)."""
    rng = np.random.default_rng(3)
    samples = []
    for i in range(n):
        sample = {"data": rng.bytes(int(rng.integers(0, 40))), "name": f"été-{i}-数据" * (i % 3)}
        for name in _NUMBERS:
            dtype = np.dtype(name)
            if dtype.kind == "f":
                sample[name] = dtype.type(rng.standard_normal() * 1e3)
            else:
                info = np.iinfo(dtype)
                sample[name] = dtype.type((info.min, info.max, i % 100)[i % 3])
        sample["img"] = rng.integers(0, 256, size=(4, 3, 2), dtype=np.uint8)
        sample["vec"] = rng.standard_normal(5).astype(np.float64)
        sample["i16"] = rng.integers(-9, 9, size=(2, 2)).astype(np.int16)
        samples.append(sample)
    return samples


def _pyarrow_records(path: str, rows: np.ndarray) -> tuple[dict[str, str], list[dict]]:
    """The schema names and records pyarrow's reader gives for file rows `rows`."""
    with pa.memory_map(path) as source:
        reader = pa.ipc.open_file(source)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        firsts = np.cumsum([0] + [b.num_rows for b in batches])
        out = []
        for row in rows.tolist():
            b = int(np.searchsorted(firsts, row, side="right") - 1)
            out += BatchRows(batches[b]).records(np.array([row - firsts[b]]))
        return schema_names(reader.schema), out


def test_every_supported_type_reads_as_pyarrow_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "_BATCH_ROWS", 7)  # many record batches in the shard
    samples = _every_type_samples(50)
    index = write_shards(samples, tmp_path / "ds")
    info = index.shards[0]
    path = str(tmp_path / "ds" / info.path)
    with open(path, "rb") as f:
        parsed = ipc.parse_file(f.read())
    assert parsed is not None
    assert [b.num_rows for b in parsed.batches] == [7] * 7 + [1]
    rows = np.array([49, 0, 13, 13, 7, 6, 48, 21, 0, 8, 35], dtype=np.int64)
    names, theirs = _pyarrow_records(path, rows)
    assert parsed.schema == names == index.schema
    with ArrowShardReader(path, info, index.schema) as reader:
        assert isinstance(reader._map, mmap.mmap)  # the `ipc` reader, not pyarrow's
        ours = reader.read_rows(rows)
    assert reader._map.closed  # no view of the map outlived the reader
    assert_same_samples(ours, theirs, "row", writeable=True)
    assert [r["name"] for r in ours] == [samples[r]["name"] for r in rows.tolist()]


def _write_with_pyarrow(path, table: pa.Table, **options) -> str:
    with pa.OSFile(str(path), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as w:
        w.write_table(table)
    return str(path)


@pytest.mark.parametrize("case", ["bool", "struct", "nulls", "compressed", "dictionary",
                                  "list", "permuted tensor"])
def test_files_outside_its_types_are_left_to_pyarrow(tmp_path, case):
    options = {}
    if case == "bool":
        table = pa.table({"x": pa.array([True, False])})
    elif case == "struct":
        table = pa.table({"x": pa.array([{"a": 1}, {"a": 2}])})
    elif case == "nulls":
        table = pa.table({"x": pa.array([1, None], type=pa.int64())})
    elif case == "compressed":
        table, options = pa.table({"x": pa.array([b"a" * 100] * 2)}), {"compression": "zstd"}
    elif case == "dictionary":
        table = pa.table({"x": pa.array(["a", "b"]).dictionary_encode()})
    elif case == "list":
        table = pa.table({"x": pa.array([[1], [2, 3]])})
    else:
        tensor = pa.fixed_shape_tensor(pa.int32(), [2, 2], permutation=[1, 0])
        storage = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(8, dtype=np.int32)), 4)
        table = pa.table({"x": pa.ExtensionArray.from_storage(tensor, storage)})
    path = _write_with_pyarrow(tmp_path / "f.arrow", table, **options)
    with open(path, "rb") as f:
        assert ipc.parse_file(f.read()) is None


def test_damaged_files_parse_to_none_or_to_buffers_inside_the_file(tmp_path):
    """Every truncation and every byte of the metadata set to 0xFF: `parse_file` returns None
    (pyarrow then names the damage) or views that lie inside the file, never raises."""
    index = write_shards(_every_type_samples(6), tmp_path / "ds")
    with open(tmp_path / "ds" / index.shards[0].path, "rb") as f:
        data = f.read()
    assert ipc.parse_file(data) is not None
    for end in range(0, len(data), 7):
        assert ipc.parse_file(data[:end]) is None
    footer_length = int.from_bytes(data[-10:-6], "little")
    # the schema and first batch messages (the first KB), and the footer
    metadata = [*range(8, 1024), *range(len(data) - 10 - footer_length, len(data))]
    for i in metadata:
        for value in (0xFF, 0x80):  # 0x80: the sign bit of a little-endian number's last byte
            damaged = bytearray(data)
            damaged[i] = value
            parsed = ipc.parse_file(bytes(damaged))
            assert parsed is None or isinstance(parsed, ipc.IpcFile)
            if parsed is not None:
                assert all(batch.num_rows >= 0 for batch in parsed.batches)


def test_tensor_metadata_nested_past_the_recursion_limit_is_left_to_pyarrow(tmp_path):
    field = pa.field("t", pa.list_(pa.float32(), 2), metadata={
        "ARROW:extension:name": "arrow.fixed_shape_tensor",
        "ARROW:extension:metadata": "[" * 100_000})
    table = pa.table([pa.array([[1.0, 2.0]], type=pa.list_(pa.float32(), 2))],
                     schema=pa.schema([field]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert ipc.parse_file(sink.getvalue().to_pybytes()) is None


def test_a_loader_over_local_arrow_data_loads_no_pyarrow_nor_fsspec(tmp_path):
    """The training process and its workers read the shards without importing pyarrow (what
    it would cost them: see `shardloader.format.ipc`), nor fsspec (a local index is opened
    as a file)."""
    write_shards(make_samples(96, seed=1, array=True), tmp_path / "ds", shard_samples=32)
    script = textwrap.dedent("""
        import json, sys
        from shardloader import Dataset, Loader

        def transform(record):
            record["worker_loaded_either"] = int("pyarrow" in sys.modules or "fsspec" in sys.modules)
            return record

        loader = Loader(Dataset(sys.argv[1]), batch_size=16, num_workers=2,
                        transform=transform, shuffle=True, seed=0)
        seen = []
        with loader:
            for batch in loader:
                seen += batch["worker_loaded_either"].tolist()
        print(json.dumps({"rows": len(seen), "workers": sorted(set(seen)),
                          "main": "pyarrow" in sys.modules or "fsspec" in sys.modules}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ds")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"rows": 96, "workers": [0], "main": False}


def test_a_batch_parsed_for_some_rows_checks_the_offsets_of_those_rows(tmp_path):
    """`parse_batch(..., rows)` (a file image read by range holds only the rows' own offsets):
    offsets of other rows are not looked at, a read row's offsets out of order or past the
    data decline the batch (pyarrow then reads it and names the damage)."""
    write_shards([{"data": bytes([i]) * (i + 1)} for i in range(8)], tmp_path / "ds")
    path = str(tmp_path / "ds" / "shard-00000.arrow")
    data = bytearray(open(path, "rb").read())
    layout = ipc.parse_layout(data)
    batch = ipc.parse_batch(data, layout, 0)
    offsets = batch.columns[0][1][0]
    at = offsets.ctypes.data - np.frombuffer(data, np.uint8).ctypes.data  # offsets' place in the file
    sixth = at + 4 * 6  # int32 offsets: where row 5 ends and row 6 starts, now past the data
    data[sixth:sixth + 4] = (10_000).to_bytes(4, "little")
    rows = np.array([0, 2], dtype=np.int64)
    assert ipc.parse_file(data) is None  # the whole file: damaged
    assert ipc.BatchReader(ipc.parse_batch(data, layout, 0, rows)).records(rows) == [
        {"data": b"\x00"}, {"data": b"\x02" * 3}]  # rows 0 and 2 do not touch offset 6
    assert ipc.parse_batch(data, layout, 0, np.array([5], dtype=np.int64)) is None
    assert ipc.parse_batch(data, layout, 0, np.array([6], dtype=np.int64)) is None
