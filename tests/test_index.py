"""index.json: indexing tars/Parquet in place, bad indexes, and verification."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardloader import Dataset, write_shards
from shardloader.errors import (
    ChecksumMismatch,
    DatasetIndexError,
    SchemaError,
    ShardError,
    ShardloaderError,
    UnsafePathError,
)
from shardloader.format.index import INDEX_NAME, Index
from shardloader.ingest.indexer import index_dataset
from shardloader.ingest.verify import verify_dataset
from shardloader.source.index import load_index
from tests.fixtures.data import copy_dataset


def _edit_index(root: str, edit) -> None:
    path = os.path.join(root, INDEX_NAME)
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


def test_index_tars_in_place_matches_writer(tar_dataset, tmp_path):
    root = copy_dataset(tar_dataset, tmp_path)
    for name in os.listdir(root):
        if not name.endswith(".tar"):
            os.remove(os.path.join(root, name))
    index = index_dataset(root)
    assert index.to_json() == tar_dataset.index.to_json()  # same entries, sidecars, checksums
    assert sorted(os.listdir(root)) == sorted(os.listdir(tar_dataset.path))
    assert index_dataset(root).fingerprint == index.fingerprint  # re-indexing is stable


def test_index_out_elsewhere(tar_dataset, tmp_path):
    out = tmp_path / "out"
    index = index_dataset(tar_dataset.path, out=str(out))
    assert sorted(os.listdir(out)) == ["index.json"] + sorted(
        f"shard-0000{i}.tar{suffix}" for i in range(3) for suffix in (".idx", ".ranges"))
    assert index.num_samples == 150


def test_mixed_schemas_across_shards_names_both(tmp_path):
    with wds.TarWriter(str(tmp_path / "a.tar")) as sink:
        sink.write({"__key__": "x", "jpg": b"1", "cls": b"0"})
    with wds.TarWriter(str(tmp_path / "b.tar")) as sink:
        sink.write({"__key__": "y", "png": b"1", "cls": b"0"})
    with pytest.raises(SchemaError, match=r"shards 'a.tar' and 'b.tar' have different schemas: field 'jpg' \(binary\) is missing; unexpected field 'png'"):
        index_dataset(str(tmp_path))
    assert not os.path.exists(tmp_path / INDEX_NAME)


def test_mixed_parquet_schemas(tmp_path):
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "p0.parquet")
    pq.write_table(pa.table({"a": [1.0, 2.0]}), tmp_path / "p1.parquet")
    with pytest.raises(SchemaError, match=r"shards 'p0.parquet' and 'p1.parquet' .*'a' is float64, expected int64"):
        index_dataset(str(tmp_path))


def test_nothing_to_index(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ShardloaderError, match=r"no .tar or .parquet files to index"):
        index_dataset(str(tmp_path))
    with pytest.raises(DatasetIndexError, match="no index.json found"):
        Dataset(tmp_path)
    with wds.TarWriter(str(tmp_path / "empty.tar")):
        pass
    with pytest.raises(SchemaError, match="every shard is empty; no schema to index"):
        index_dataset(str(tmp_path))


def test_unindexed_folder_hints_at_index_command(tar_dataset, tmp_path):
    root = copy_dataset(tar_dataset, tmp_path)
    os.remove(os.path.join(root, INDEX_NAME))
    with pytest.raises(DatasetIndexError) as info:
        Dataset(root)
    assert f"run `shardloader index {root}` to index them in place" in str(info.value)


@pytest.mark.parametrize("text,message", [
    ("{not json", r"index.json: not valid JSON"),
    ('{"format": "shardloader-index", "version": 2, "schema": {}, "shards": []}',
     r"index.json: index version 2 is not supported"),
    ('{"format": "other", "version": 1}', r"index.json: not a shardloader index"),
    ('{"format": "shardloader-index", "version": 1, "schema": {}, "shards": [{"path": "a"}]}',
     r"index.json: shards\[0\]: shard entry lacks format, samples, bytes, checksum"),
])
def test_malformed_index(tmp_path, text, message):
    (tmp_path / INDEX_NAME).write_text(text)
    with pytest.raises(DatasetIndexError, match=message):
        Dataset(tmp_path)


@pytest.mark.parametrize("bad_path,message", [
    ("../x.arrow", "escapes its root"), ("/abs/x.arrow", "is absolute"),
])
def test_shard_path_escaping_root(arrow_dataset, tmp_path, bad_path, message):
    root = copy_dataset(arrow_dataset, tmp_path)
    _edit_index(root, lambda d: d["shards"][1].update(path=bad_path))
    with pytest.raises(UnsafePathError, match=rf"index.json: shards\[1\].*{message}"):
        Dataset(root)
    with pytest.raises(UnsafePathError):
        verify_dataset(root)


def test_missing_shard_file(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    os.remove(os.path.join(root, "shard-00003.arrow"))
    ds = Dataset(root)
    assert ds[0]["name"] == arrow_dataset.samples[0]["name"]
    with pytest.raises(ShardError, match=r"shard-00003.arrow: shard file is missing"):
        ds[199]
    assert verify_dataset(root) == [f"{root}/shard-00003.arrow: missing"]


def test_checksum_mismatch_and_verify(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    path = os.path.join(root, "shard-00001.arrow")
    with open(path, "r+b") as f:
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatch, match=rf"{path}: checksum xxh3_128:[0-9a-f]+ does not match the index"):
        Dataset(root)[64]
    problems = verify_dataset(root)
    assert len(problems) == 1 and problems[0].startswith(f"{root}/shard-00001.arrow: checksum")


def test_verify_clean_and_sidecar_problems(tar_dataset, parquet_dataset, arrow_dataset, tmp_path):
    for fixture in (tar_dataset, parquet_dataset, arrow_dataset):
        assert verify_dataset(fixture.path) == []
    root = copy_dataset(tar_dataset, tmp_path)
    with open(os.path.join(root, "shard-00001.tar.idx"), "ab") as f:
        f.write(b"extra")
    os.remove(os.path.join(root, "shard-00002.tar.idx"))
    with open(os.path.join(root, "shard-00000.tar"), "r+b") as f:
        f.truncate(1000)
    problems = verify_dataset(root)
    assert len(problems) == 3
    assert problems[0].startswith(f"{root}/shard-00000.tar: 1000 bytes but the index records")
    assert problems[1].startswith(f"{root}/shard-00001.tar.idx: ") and "larger than expected" in problems[1]
    assert problems[2] == f"{root}/shard-00002.tar.idx: missing"


def test_verify_reports_count_mismatch_with_matching_checksum(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    _edit_index(root, lambda d: d["shards"][3].update(samples=9))
    assert verify_dataset(root) == [
        f"{root}/shard-00003.arrow: shard holds 8 rows but the index records 9"
    ]


def test_index_round_trip_and_fingerprint(arrow_dataset):
    index = load_index(arrow_dataset.path)
    again = Index.loads(index.dumps())
    assert again == index and again.fingerprint == index.fingerprint
    changed = Index.from_json({**index.to_json(), "schema": {"x": "binary"}})
    assert changed.fingerprint != index.fingerprint


def test_repeated_shard_path_rejected(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    _edit_index(root, lambda d: d["shards"][2].update(path="shard-00000.arrow"))
    with pytest.raises(DatasetIndexError, match=r"shards\[2\] repeats path 'shard-00000.arrow'"):
        Dataset(root)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    counts=st.lists(st.integers(min_value=0, max_value=15), min_size=1, max_size=5).filter(any),
    sizes=st.lists(st.integers(min_value=0, max_value=2000), min_size=1, max_size=8),
)
def test_property_index_tars_then_read(counts, sizes):
    """Tars written by webdataset with random sample counts and member sizes, indexed in place."""
    tmp = tempfile.mkdtemp()
    try:
        expected = []
        for shard, count in enumerate(counts):
            with wds.TarWriter(os.path.join(tmp, f"part-{shard:02d}.tar")) as sink:
                for i in range(count):
                    data = bytes([(shard * 31 + i) % 256]) * sizes[(shard + i) % len(sizes)]
                    record = {"__key__": f"{shard:02d}-{i:03d}", "bin": data, "txt": f"{shard}/{i}"}
                    sink.write(record)
                    expected.append(record)  # the .txt member reads back decoded
        index = index_dataset(tmp)
        assert [s.samples for s in index.shards] == counts
        assert index.sample_offsets.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()
        ds = Dataset(tmp)
        order = list(range(len(ds)))[::-1]
        got = [{k: v for k, v in r.items() if k != "__index__"} for r in ds.get_many(order)]
        assert got == [expected[i] for i in order]
        assert verify_dataset(tmp) == []
        ds.close()
    finally:
        shutil.rmtree(tmp)


def test_writer_index_is_readable_by_load_index(tmp_path):
    index = write_shards([{"v": i} for i in range(5)], tmp_path / "ds", shard_samples=2)
    assert load_index(str(tmp_path / "ds")) == index


def test_index_write_and_verify_on_s3(tar_dataset, s3_server, s3_url, tmp_path):
    """Remote datasets: index tars in place in a bucket, write shards to a bucket, verify both."""
    opts = s3_server.storage_options()
    only_tars = tmp_path / "tars"
    only_tars.mkdir()
    for name in sorted(os.listdir(tar_dataset.path)):
        if name.endswith(".tar"):
            shutil.copy(os.path.join(tar_dataset.path, name), only_tars / name)
    url = s3_url(only_tars)
    index = index_dataset(url, storage_options=opts)
    assert index.to_json() == tar_dataset.index.to_json()  # same checksums and sidecars
    assert verify_dataset(url, opts) == []
    ds = Dataset(url, cache_dir=tmp_path / "cache", storage_options=opts)
    assert [_strip(r) for r in ds.get_many([149, 0, 75])] == [tar_dataset.samples[i] for i in (149, 0, 75)]
    ds.close()

    bucket = url.split("/")[2]
    s3_server.put(bucket, "ds/shard-00001.tar.idx", b"not a sidecar")
    s3_server.put(bucket, "ds/shard-00002.tar", b"x" * tar_dataset.index.shards[2].bytes)
    problems = verify_dataset(url, opts)
    assert len(problems) == 2
    assert problems[0].startswith(f"{url}/shard-00001.tar.idx: 13 bytes but the index records")
    assert problems[1].startswith(f"{url}/shard-00002.tar: checksum ")

    out = f"s3://{bucket}/written"
    written = write_shards([{"v": i, "s": f"ü{i}"} for i in range(30)], out, shard_samples=8,
                           format="tar", storage_options=opts)
    assert [s.samples for s in written.shards] == [8, 8, 8, 6]
    assert load_index(out, opts) == written
    assert verify_dataset(out, opts) == []


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "__index__"}
