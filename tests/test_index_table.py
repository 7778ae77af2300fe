"""The table form of the index (`shardloader.format.index_table`): round trip, datasets,
damaged and hostile tables, remote roots, and the JSON form alongside."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest

from shardloader import Dataset, Loader, write_shards
from shardloader.errors import DatasetIndexError, UnsafePathError
from shardloader.format.index import INDEX_NAME, Index, ShardInfo
from shardloader.format.index_table import TABLE_NAME, table_form
from shardloader.io.checksum import checksum_bytes
from shardloader.source.index import load_index


def _samples(n: int = 60) -> list[dict]:
    return [{"image": bytes([i % 256]) * (i + 1), "label": i} for i in range(n)]


def _save(root, index: Index) -> None:
    document, table = table_form(index)
    (root / INDEX_NAME).write_bytes(document)
    (root / TABLE_NAME).write_bytes(table)


def _index(n: int = 6) -> Index:
    shards = [ShardInfo(f"part/shard-{i:05d}.tar", "tar" if i % 2 else "arrow", 3 * i, 100 + i,
                        "xxh3_128:" + f"{i * 7919:032x}",
                        {"sidecar": f"part/shard-{i:05d}.tar.idx", "n": [i, None]} if i % 2 else {})
              for i in range(n)]
    return Index({"image": "binary", "label": "int64"}, shards)


def test_both_forms_round_trip_field_by_field(tmp_path):
    index = _index()
    _save(tmp_path, index)
    loaded = load_index(str(tmp_path))
    assert loaded == index == Index.loads(index.dumps())
    for a, b in zip(loaded.shards, index.shards):
        assert (a.path, a.format, a.samples, a.bytes, a.checksum, dict(a.extra)) == \
               (b.path, b.format, b.samples, b.bytes, b.checksum, dict(b.extra))
    assert loaded.shards[1].extra == {"sidecar": "part/shard-00001.tar.idx", "n": [1, None]}
    assert list(loaded.sample_offsets) == list(index.sample_offsets)
    assert loaded.formats == index.formats


def test_fingerprint_is_the_documents_and_differs_from_the_json_forms(tmp_path):
    index = _index()
    _save(tmp_path, index)
    first = load_index(str(tmp_path)).fingerprint
    assert first == load_index(str(tmp_path)).fingerprint
    assert first != index.fingerprint


def test_an_index_of_no_shards_round_trips(tmp_path):
    index = Index({"a": "int64"}, ())
    _save(tmp_path, index)
    assert load_index(str(tmp_path)) == index


@pytest.mark.parametrize("fmt", ["arrow", "tar"])
def test_datasets_in_both_forms_read_the_same_samples(tmp_path, fmt):
    samples = _samples()
    kw = {"shard_samples": 7, "format": fmt}
    if fmt == "tar":
        samples = [{"__key__": f"k{i:04d}", "image": s["image"]} for i, s in enumerate(samples)]
    plain = write_shards(samples, tmp_path / "json", shard_table="json", **kw)
    table = write_shards(samples, tmp_path / "table", shard_table="table", **kw)
    assert not (tmp_path / "json" / TABLE_NAME).exists() and (tmp_path / "table" / TABLE_NAME).exists()
    assert "shards" not in json.loads((tmp_path / "table" / INDEX_NAME).read_text())
    a, b = Dataset(str(tmp_path / "json")), Dataset(str(tmp_path / "table"))
    assert a.index == b.index == plain == table
    rows = list(range(len(samples)))
    assert a.get_many(rows) == b.get_many(rows)
    batches = [list(Loader(d, batch_size=8, num_workers=2, seed=5)) for d in (a, b)]
    assert len(batches[0]) == len(batches[1]) > 0
    for x, y in zip(*batches):
        assert x.keys() == y.keys()
        for key in x:
            assert np.array_equal(np.asarray(x[key], dtype=object), np.asarray(y[key], dtype=object))


def test_auto_keeps_small_datasets_in_json(tmp_path):
    write_shards(_samples(10), tmp_path / "d", shard_samples=5)
    assert "shards" in json.loads((tmp_path / "d" / INDEX_NAME).read_text())
    assert not (tmp_path / "d" / TABLE_NAME).exists()


def _refused(root, match: str, error: type[Exception] = DatasetIndexError) -> None:
    with pytest.raises(error, match=match) as info:
        load_index(str(root))
    assert TABLE_NAME in str(info.value) or INDEX_NAME in str(info.value)


def test_a_changed_byte_is_refused(tmp_path):
    _save(tmp_path, _index())
    data = bytearray((tmp_path / TABLE_NAME).read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / TABLE_NAME).write_bytes(bytes(data))
    _refused(tmp_path, "index.shards.arrow: the shard table's checksum differs")


def test_a_truncated_table_is_refused(tmp_path):
    _save(tmp_path, _index())
    data = (tmp_path / TABLE_NAME).read_bytes()
    (tmp_path / TABLE_NAME).write_bytes(data[:-10])
    _refused(tmp_path, r"index.shards.arrow: the shard table has \d+ bytes, index.json says")


def test_a_missing_table_is_refused(tmp_path):
    _save(tmp_path, _index())
    os.remove(tmp_path / TABLE_NAME)
    _refused(tmp_path, "shard table that .* names is missing")


def _hostile(root, **columns) -> None:
    """A table written with `columns` replaced, re-signed in index.json (as an attacker could)."""
    index = _index()
    _save(root, index)
    table = pa.ipc.open_file(str(root / TABLE_NAME)).read_all()
    for name, values in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name,
                                 pa.array(values, table.schema.field(name).type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    document = json.loads((root / INDEX_NAME).read_text())
    document["shard_table"].update(bytes=len(data), checksum=checksum_bytes(data))
    (root / TABLE_NAME).write_bytes(data)
    (root / INDEX_NAME).write_text(json.dumps(document))


@pytest.mark.parametrize("column, values, match", [
    ("samples", [0, 1, -5, 3, 4, 5], "column 'samples', row 2: -5 is outside"),
    ("samples", [0, 1, 2**49, 3, 4, 5], r"column 'samples', row 2: \d+ is outside"),
    ("samples", [2**48] * 6, "column 'samples' adds up to more than"),
    ("bytes", [0, 1, 2, 2**63 - 1, 4, 5], "column 'bytes', row 3"),
    ("format", [0, 1, 7, 0, 1, 0], "column 'format', row 2: 7 is outside"),
    ("digest", [b"x" * 16] * 5 + [b"y"], "column 'digest', row 5: a digest of 1 bytes"),
    ("path", ["a", "b", "a", "c", "d", "e"], "column 'path', row 2 repeats path 'a' .also row 0."),
    ("path", ["a", "a/./b", "c", "d", "e", "f"], "row 1: path 'a/./b' is not in normal form"),
])
def test_hostile_counts_and_paths_are_refused(tmp_path, column, values, match):
    _hostile(tmp_path, **{column: values})
    _refused(tmp_path, match)


@pytest.mark.parametrize("path", ["/etc/passwd", "a/../../x", "a\x00b", "", "c:/x", "a\\b"])
def test_unsafe_paths_are_refused(tmp_path, path):
    _hostile(tmp_path, path=["p0", path, "p2", "p3", "p4", "p5"])
    _refused(tmp_path, "column 'path', row 1", UnsafePathError)


def test_a_table_entry_with_a_bad_field_is_refused(tmp_path):
    _save(tmp_path, _index())
    document = json.loads((tmp_path / INDEX_NAME).read_text())
    document["shard_table"]["formats"] = ["zip"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(document))
    _refused(tmp_path, "field 'formats' must list known shard formats")


def test_index_loads_without_the_table_says_how_to_open_it(tmp_path):
    document, _ = table_form(_index())
    with pytest.raises(DatasetIndexError, match="keeps its shards in a table file"):
        Index.loads(document)


def test_a_remote_table_form_dataset_loads(tmp_path, s3_server, s3_bucket):
    write_shards(_samples(), tmp_path / "d", shard_samples=7, shard_table="table")
    url = s3_server.upload_dir(str(tmp_path / "d"), s3_bucket, "ds")
    remote = Dataset(url, cache_dir=str(tmp_path / "cache"), storage_options=s3_server.storage_options())
    local = Dataset(str(tmp_path / "d"))
    assert remote.index == local.index and remote.index.fingerprint == local.index.fingerprint
    assert remote.get_many([0, 13, 59]) == local.get_many([0, 13, 59])


def test_the_json_form_still_loads(tmp_path):
    index = write_shards(_samples(), tmp_path / "d", shard_samples=7)
    assert load_index(str(tmp_path / "d")) == index


def test_the_indexer_writes_either_form(tmp_path):
    from shardloader.ingest.indexer import index_dataset

    samples = [{"__key__": f"k{i:04d}", "image": bytes([i]) * 9} for i in range(30)]
    write_shards(samples, tmp_path / "tars", shard_samples=7, format="tar")
    plain = index_dataset(str(tmp_path / "tars"), out=str(tmp_path / "a"), shard_table="json")
    table = index_dataset(str(tmp_path / "tars"), out=str(tmp_path / "b"), shard_table="table")
    assert (tmp_path / "b" / TABLE_NAME).exists() and not (tmp_path / "a" / TABLE_NAME).exists()
    loaded = load_index(str(tmp_path / "b"))
    assert loaded == plain == table and load_index(str(tmp_path / "a")) == plain
    assert loaded.shards[0].extra == plain.shards[0].extra != {}


def test_repeated_long_paths_are_refused(tmp_path):
    long = "d/" * 60 + "x.arrow"  # past the per-position hashing: the other way finds it too
    _hostile(tmp_path, path=["p0", long, "p2", long[:-1], long, "p5"])
    _refused(tmp_path, "column 'path', row 4 repeats path")


def test_rewriting_a_table_form_dataset_in_json_form_leaves_no_table_behind(tmp_path):
    """overwrite=True (or a re-index) in the JSON form removes the table that no index names
    any more; the dataset reads as the new one."""
    root = tmp_path / "d"
    write_shards(_samples(), root, shard_samples=7, shard_table="table")
    assert (root / TABLE_NAME).exists()
    index = write_shards(_samples(10), root, shard_samples=5, shard_table="json", overwrite=True)
    assert not (root / TABLE_NAME).exists()
    assert load_index(str(root)) == index and len(Dataset(str(root))) == 10
