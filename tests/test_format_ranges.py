"""Range tables (shardloader.format.ranges): the spans they record hold exactly the rows' bytes,
and rows rebuilt from those spans equal the rows the local readers return, bit for bit."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardloader.errors import SchemaError, ShardError
from shardloader.format.index import ShardInfo
from shardloader.format.ranges import RANGES_KEY, RangeTable, span_hash
from shardloader.format.registry import open_shard, rows_from_spans, table_of_file
from shardloader.format.tar import load_offsets
from shardloader.ingest.indexer import index_dataset
from shardloader.ingest.writer import write_shards
from shardloader.io.checksum import checksum_file
from tests.resume import assert_same_samples

ROWS = [5, 0, 299, 17, 5, 150, 298]  # any order, repeats, both ends


def _arrow_samples(n: int):
    rng = np.random.default_rng(0)
    for i in range(n):
        yield {"data": rng.bytes(int(rng.integers(0, 600))), "label": i, "text": "é" * (i % 9),
               "f": float(i) / 3, "flag": bool(i % 3), "u8": np.uint8(i % 256),
               "t": np.full((2, 3), i, np.float32),
               "st": {"bytes": rng.bytes(int(rng.integers(1, 20))), "path": f"p{i}"}}


def _by_range(table: RangeTable, path: str, rows, tar=None) -> list[dict]:
    """Rows rebuilt from only the spans `table` says they need, each checked against its hash."""
    data = open(path, "rb").read()
    fetched = {}
    for i in table.needed(rows).tolist():
        offset, length = table.spans[i].tolist()
        fetched[i] = data[offset:offset + length]
        assert span_hash(fetched[i]) == int(table.hashes[i])
    return rows_from_spans(table, fetched, rows, where=path, tar_offsets=tar)


@pytest.mark.parametrize("fmt", ["arrow", "tar"])
def test_rows_by_range_equal_rows_of_the_whole_shard(tmp_path, fmt):
    samples = _arrow_samples(300) if fmt == "arrow" else (
        {"data": s["data"], "cls": s["label"], "txt": s["text"]} for s in _arrow_samples(300))
    index = write_shards(samples, tmp_path / "ds", shard_samples=300, format=fmt)
    info = index.shards[0]
    path = str(tmp_path / "ds" / info.path)
    entry = info.extra[RANGES_KEY]
    sidecar = (tmp_path / "ds" / entry["path"]).read_bytes()
    assert len(sidecar) == entry["bytes"]
    table = RangeTable.decode(sidecar, where="sidecar")
    tar = load_offsets(path, info) if fmt == "tar" else None
    got = _by_range(table, path, ROWS, tar)
    want = open_shard(info, path, index.schema).read_rows(ROWS)
    assert_same_samples(got, want, "row")
    assert table.needed_bytes(table.needed(ROWS)) < info.bytes / 4  # only what the rows need


def test_arrow_rows_across_record_batches(tmp_path, monkeypatch):
    monkeypatch.setattr("shardloader.ingest.writer._BATCH_ROWS", 64)
    index = write_shards(_arrow_samples(300), tmp_path / "ds", shard_samples=300)
    info = index.shards[0]
    path = str(tmp_path / "ds" / info.path)
    table = table_of_file(path, "arrow")
    assert len(table.group_rows) - 1 == 5
    got = _by_range(table, path, ROWS)
    want = open_shard(info, path, index.schema).read_rows(ROWS)
    assert_same_samples(got, want, "row")


def test_arrow_rows_by_range_equal_the_whole_files_values(tmp_path, monkeypatch):
    """Rows of a shard of every column kind the writer makes, rebuilt from an image that holds
    only the spans the rows need (zeros elsewhere), equal the rows read from the whole file
    bit for bit."""
    monkeypatch.setattr("shardloader.ingest.writer._BATCH_ROWS", 64)
    rng = np.random.default_rng(1)
    samples = [{"data": rng.bytes(int(rng.integers(0, 600))), "label": i, "text": "é" * (i % 9),
                "f": float(i) / 3, "u8": np.uint8(i % 256), "t": np.full((2, 3), i, np.float32)}
               for i in range(300)]
    index = write_shards(samples, tmp_path / "ds", shard_samples=300)
    info = index.shards[0]
    path = str(tmp_path / "ds" / info.path)
    table = table_of_file(path, "arrow")
    got = _by_range(table, path, ROWS)
    want = open_shard(info, path, index.schema).read_rows(ROWS)
    assert len(got) == len(ROWS)
    assert_same_samples(got, want, "row")
    assert [r["label"] for r in got] == ROWS
    assert all(r["t"].flags.writeable for r in got)


def test_parquet_rows_by_row_group(tmp_path):
    table = pa.table({"data": [bytes([i % 256]) * (i % 50) for i in range(1000)],
                      "label": list(range(1000)), "name": [f"n{i}" for i in range(1000)]})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=100)
    index = index_dataset(str(tmp_path))
    info = index.shards[0]
    path = str(tmp_path / "p.parquet")
    ranges = RangeTable.decode((tmp_path / info.extra[RANGES_KEY]["path"]).read_bytes(), where="x")
    rows = [999, 3, 450, 451, 3]
    got = _by_range(ranges, path, rows)
    assert got == open_shard(info, path, index.schema).read_rows(rows)
    assert ranges.needed_bytes(ranges.needed(rows)) < info.bytes / 2  # 3 of 10 row groups


def test_indexer_writes_range_sidecars_for_tars(tmp_path):
    write_shards(({"data": bytes([i]) * i, "cls": i} for i in range(40)), tmp_path / "ds",
                 shard_samples=20, format="tar")
    (tmp_path / "ds" / "index.json").unlink()
    for sidecar in (tmp_path / "ds").glob("*.ranges"):
        sidecar.unlink()
    index = index_dataset(str(tmp_path / "ds"))
    for info in index.shards:
        path = str(tmp_path / "ds" / info.path)
        table = RangeTable.decode((tmp_path / "ds" / info.extra[RANGES_KEY]["path"]).read_bytes(), where="x")
        want = open_shard(info, path, index.schema).read_rows([0, 19, 7])
        assert _by_range(table, path, [0, 19, 7], load_offsets(path, info)) == want


def test_a_damaged_sidecar_is_a_clear_error(tmp_path):
    index = write_shards(({"v": bytes(i)} for i in range(10)), tmp_path / "ds")
    data = (tmp_path / "ds" / index.shards[0].extra[RANGES_KEY]["path"]).read_bytes()
    with pytest.raises(ShardError, match="where: not a shardloader range sidecar"):
        RangeTable.decode(b"garbage" + data, where="where")
    with pytest.raises(ShardError, match="where: range sidecar is truncated"):
        RangeTable.decode(data[:-3], where="where")


def test_parquet_entry_sizes(tmp_path):
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "a.parquet")
    checksum, size = checksum_file(str(tmp_path / "a.parquet"))
    info = ShardInfo("a.parquet", "parquet", 3, size, checksum)
    table = table_of_file(str(tmp_path / "a.parquet"), "parquet")
    assert table.shard_bytes == info.bytes and table.rows == 3
    assert _by_range(table, str(tmp_path / "a.parquet"), [2, 0]) == [{"x": 3}, {"x": 1}]


def test_verify_names_a_damaged_range_sidecar(tmp_path):
    from shardloader.ingest.verify import verify_dataset

    index = write_shards(({"v": bytes(i)} for i in range(10)), tmp_path / "ds")
    assert verify_dataset(str(tmp_path / "ds")) == []
    sidecar = tmp_path / "ds" / index.shards[0].extra[RANGES_KEY]["path"]
    data = bytearray(sidecar.read_bytes())
    data[-1] ^= 0xFF
    sidecar.write_bytes(bytes(data))
    problems = verify_dataset(str(tmp_path / "ds"))
    assert len(problems) == 1 and "shard-00000.arrow.ranges: checksum" in problems[0]


def test_a_record_batch_with_nulls_is_read_and_the_null_named(tmp_path):
    """A file written elsewhere whose middle record batch holds a null: rows outside it, and
    rows of it that are not null, read by range; a null row is named as for the whole shard."""
    values = [None if i == 60 else i for i in range(120)]
    table = pa.table({"data": [bytes([i % 256]) * (i % 30) for i in range(120)],
                      "x": pa.array(values, type=pa.int64())})
    path = str(tmp_path / "f.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=50)  # batches of rows 0-49, 50-99, 100-119
    ranges = table_of_file(path, "arrow")
    for rows in ([119, 0, 5, 0], [3, 51]):  # row 51 lies in the batch with the null
        got = _by_range(ranges, path, rows)
        assert [(r["x"], r["data"]) for r in got] == [(v, bytes([v % 256]) * (v % 30)) for v in rows]
    with pytest.raises(SchemaError, match=r"f\.arrow: row 60: field 'x' is null"):
        _by_range(ranges, path, [3, 60])

