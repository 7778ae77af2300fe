"""Arrow IPC shards: round trips, row access, and damaged files."""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pyarrow as pa
import pytest

from shardloader import Dataset, write_shards
from shardloader.errors import SchemaError, ShardChangedError, ShardError
from shardloader.format.arrow import ArrowShardReader
from shardloader.ingest import writer
from tests.fixtures.data import copy_dataset, make_samples
from tests.resume import assert_same_samples


def test_round_trip_every_sample(arrow_dataset):
    ds = Dataset(arrow_dataset)
    assert len(ds) == len(arrow_dataset.samples) == 200
    assert [s.samples for s in ds.index.shards] == [64, 64, 64, 8]
    assert_same_samples([ds[i] for i in range(len(arrow_dataset.samples))], arrow_dataset.samples,
                        skip=["__index__"])


def test_reader_values_and_types(arrow_dataset):
    info = arrow_dataset.index.shards[1]
    with ArrowShardReader(os.path.join(arrow_dataset.path, info.path), info,
                          arrow_dataset.index.schema) as reader:
        record = reader.read(5)
        assert isinstance(record["data"], bytes)
        assert isinstance(record["label"], int)
        assert isinstance(record["name"], str)
        assert isinstance(record["vec"], np.ndarray) and record["vec"].shape == (3,)
        assert record["vec"].flags.writeable
        assert_same_samples([record], [arrow_dataset.samples[64 + 5]], "read(5)", skip=["__index__"])


def test_read_rows_across_record_batches_keeps_order(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "_BATCH_ROWS", 7)  # many record batches per shard
    samples = make_samples(60, seed=5, array=True)
    index = write_shards(samples, tmp_path / "ds")
    info = index.shards[0]
    reader = ArrowShardReader(str(tmp_path / "ds" / info.path), info, index.schema)
    assert len(reader._batches) == 9
    rows = [59, 0, 13, 13, 7, 6, 58, 21, 0]
    records = reader.read_rows(rows)
    assert [r["name"] for r in records] == [samples[r]["name"] for r in rows]
    assert_same_samples(records, [samples[r] for r in rows], "row", skip=["__index__"])
    assert reader.read_rows([]) == []
    with pytest.raises(IndexError, match="out of range"):
        reader.read_rows([60])
    reader.close()


def test_binary_rows_are_read_at_their_place_in_the_file(tmp_path):
    """Binary and string values are read with pread, not through the mapping: byte for byte
    the same, and a shard of only such columns and numbers gives no pages back after a read
    (there are none to give); one with a tensor column does."""
    plain = [{"data": os.urandom(100 + i), "name": f"n{i}", "label": i} for i in range(50)]
    index = write_shards(plain, tmp_path / "plain")
    info = index.shards[0]
    with ArrowShardReader(str(tmp_path / "plain" / info.path), info, index.schema) as reader:
        rows = [49, 0, 7, 7, 30]
        assert reader.read_rows(rows) == [plain[r] for r in rows]
        assert not reader._drop_pages
    with_tensor = make_samples(20, seed=1, array=True)
    index = write_shards(with_tensor, tmp_path / "tensor")
    info = index.shards[0]
    with ArrowShardReader(str(tmp_path / "tensor" / info.path), info, index.schema) as reader:
        assert reader._drop_pages


def test_a_shard_shortened_between_the_check_and_the_read_is_named(tmp_path, monkeypatch):
    samples = [{"data": os.urandom(4000), "label": i} for i in range(40)]
    index = write_shards(samples, tmp_path / "ds")
    info = index.shards[0]
    path = str(tmp_path / "ds" / info.path)
    reader = ArrowShardReader(path, info, index.schema)
    monkeypatch.setattr(reader._guard, "check", lambda: None)  # the race: after the check
    with open(path, "r+b") as f:
        f.truncate(info.bytes // 3)
    with pytest.raises(ShardChangedError, match=rf"{path}: the file is shorter than when it was opened"):
        reader.read_rows([39])
    reader.close()


def test_truncated_shard_is_named(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    info = arrow_dataset.index.shards[2]
    path = os.path.join(root, info.path)
    with open(path, "r+b") as f:
        f.truncate(info.bytes // 2)
    with pytest.raises(ShardError, match=rf"{info.path}.*truncated"):
        Dataset(root)[64 * 2]
    with pytest.raises(ShardError, match=rf"{path}: not a readable Arrow IPC file"):
        ArrowShardReader(path, info)


def test_corrupt_shard_is_named(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    info = arrow_dataset.index.shards[0]
    path = os.path.join(root, info.path)
    with open(path, "r+b") as f:
        f.seek(info.bytes - 30)
        f.write(b"\xff" * 20)  # damage the footer
    with pytest.raises(ShardError, match=rf"{path}: checksum .* does not match"):
        Dataset(root)[0]
    with pytest.raises(ShardError, match=rf"{path}: not a readable Arrow IPC file"):
        ArrowShardReader(path, info)


def test_not_an_arrow_file(tmp_path, arrow_dataset):
    path = tmp_path / "garbage.arrow"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ShardError, match="garbage.arrow: not a readable Arrow IPC file"):
        ArrowShardReader(str(path), arrow_dataset.index.shards[0])


def test_missing_file(tmp_path, arrow_dataset):
    with pytest.raises(ShardError, match="nope.arrow: shard file is missing"):
        ArrowShardReader(str(tmp_path / "nope.arrow"), arrow_dataset.index.shards[0])


def test_sample_count_must_match_index(arrow_dataset):
    info = arrow_dataset.index.shards[0]
    wrong = dataclasses.replace(info, samples=info.samples + 1)
    with pytest.raises(ShardError, match=r"holds 64 rows but the index records 65"):
        ArrowShardReader(os.path.join(arrow_dataset.path, info.path), wrong)


def test_schema_must_match_index(arrow_dataset):
    info = arrow_dataset.index.shards[0]
    schema = dict(arrow_dataset.index.schema, label="float64")
    with pytest.raises(SchemaError, match=rf"{info.path}: schema differs.*'label' is int64, expected float64"):
        ArrowShardReader(os.path.join(arrow_dataset.path, info.path), info, schema)


def test_file_is_uncompressed_ipc_file_format(arrow_dataset):
    info = arrow_dataset.index.shards[0]
    with pa.memory_map(os.path.join(arrow_dataset.path, info.path)) as source:
        reader = pa.ipc.open_file(source)  # the IPC *file* format, readable by any Arrow tool
        table = reader.read_all()
    assert table.num_rows == 64
    assert table.column("data").to_pylist()[:3] == [s["data"] for s in arrow_dataset.samples[:3]]


def _resident_kib(path: str) -> int:
    """Resident KiB of this process's mappings of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    real = os.path.realpath(path)
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping line
                inside = len(head) >= 6 and os.path.realpath(head[5]) == real
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_rows_read_leave_no_shard_pages_resident(tmp_path):
    """Rows come back as copies, so the mapped pages they were read from are let go of after
    each read (the file stays mapped): a worker's RSS does not grow by the shard bytes it read."""
    rng = np.random.default_rng(5)
    samples = [{"data": rng.integers(0, 256, 16_384, dtype=np.uint8).tobytes(), "label": i}
               for i in range(256)]
    write_shards(iter(samples), str(tmp_path), shard_samples=256)
    ds = Dataset(str(tmp_path))
    info = ds.index.shards[0]
    path = os.path.join(str(tmp_path), info.path)
    with ArrowShardReader(path, info, ds.index.schema) as reader:
        rows = list(range(0, 256, 3)) + list(range(1, 256, 3)) + list(range(2, 256, 3))
        got = reader.read_rows(rows)
        assert [r["data"] for r in got] == [samples[i]["data"] for i in rows]
        assert _resident_kib(path) <= 256  # 4 MiB of rows read; at most a few metadata pages
        again = reader.read_rows([255, 0, 128])  # pages map in again on the next touch
        assert [r["data"] for r in again] == [samples[i]["data"] for i in (255, 0, 128)]


def _descriptors_on(directory: str) -> list[str]:
    """This process's open descriptors on files under `directory`."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.realpath(directory)):
            held.append(target)
    return held


@pytest.mark.parametrize("fmt", ["arrow", "tar"])
def test_a_dataset_freed_without_close_gives_its_shard_descriptors_back(tmp_path, fmt):
    """Most Datasets are never closed (a script, a test, a notebook cell run again): their
    readers' descriptors must go with them, or a process that opens datasets again and again
    runs out (a run of this suite once held over 1,024)."""
    import gc

    root = str(tmp_path / "ds")
    write_shards(make_samples(12), root, shard_samples=4, format=fmt)
    ds = Dataset(root)
    ds.get_many(np.arange(12))  # a reader per shard
    assert len(_descriptors_on(root)) >= 3
    del ds
    gc.collect()
    assert _descriptors_on(root) == []


def test_offsets_past_their_data_are_refused_at_open_naming_the_file(tmp_path):
    """Shards are untrusted: a binary column whose offsets point past its data (a hostile
    file) is a ShardError naming it when the reader opens it (pyarrow's full validation),
    before any row is read."""
    samples = [{"data": bytes([i]) * 10, "label": i} for i in range(20)]
    index = write_shards(samples, tmp_path / "ds")
    info = index.shards[0]
    path = tmp_path / "ds" / info.path
    data = bytearray(path.read_bytes())
    with pa.memory_map(str(path)) as source:
        whole = source.read_buffer()
        column = pa.ipc.open_file(whole).get_batch(0).column("data")
        # a middle offset entry (int32): pyarrow's basic validation checks only the first and last
        at = column.buffers()[1].address - whole.address + 4 * 10
    data[at:at + 4] = (10**6).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"^{re.escape(str(path))}: not a readable Arrow IPC file .*offset"):
        ArrowShardReader(str(path), info, index.schema)
