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


# -- the columnar index: 10^5 shards, answers as the entry-by-entry representation ------------
def _reference_offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _large_index_json(n: int, seed: int = 0) -> dict:
    """An index of `n` shards as the writer and indexer make them (distinct checksums, a ranges
    sidecar each, tar shards with an offsets sidecar too), plus the odd entries a hand-edited
    index may hold: empty shards, a missing sidecar, keys with floats, lists, nested dicts."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 2000, n).tolist()
    sizes = rng.integers(0, 2**40, n).tolist()
    digests = rng.integers(0, 256, (3, n, 16), dtype=np.uint8)
    shards = []
    for i in range(n):
        fmt = "tar" if i % 7 == 3 else "arrow"
        name = f"part-{i // 1000:03d}/shard-{i:06d}.{fmt}"
        entry = {"path": name, "format": fmt, "samples": counts[i], "bytes": sizes[i],
                 "checksum": "xxh3_128:" + digests[0, i].tobytes().hex()}
        if i % 1000 != 999:  # a few shards without a ranges sidecar
            entry["ranges"] = {"path": name + ".ranges", "bytes": 1000 + i % 17,
                               "checksum": "xxh3_128:" + digests[1, i].tobytes().hex()}
        if fmt == "tar":
            entry["offsets"] = {"path": name + ".idx", "bytes": 24 * counts[i],
                                "checksum": "xxh3_128:" + digests[2, i].tobytes().hex()}
        shards.append(entry)
    shards[5]["note"] = {"by": "hand", "weights": [0.5, -0.0, 1e300], "ok": True, "none": None}
    shards[6]["row_groups"] = 3
    shards[7]["ranges"]["path"] = "elsewhere/r.ranges"  # not named after its shard
    shards[8]["label"] = "ü"
    return {"format": "shardloader-index", "version": 1, "schema": {"image": "binary", "label": "int64"},
            "shards": shards}


def _canonical_fingerprint(data: dict) -> str:
    import hashlib

    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@pytest.fixture(scope="module")
def large_index_json() -> dict:
    return _large_index_json(100_000)


def test_large_index_answers_as_entry_by_entry(large_index_json):
    from shardloader.format.index import ShardInfo

    data = large_index_json
    index = Index.loads(json.dumps(data))
    reference = tuple(ShardInfo.from_json(e, where=f"shards[{i}]") for i, e in enumerate(data["shards"]))
    n = len(reference)
    assert index.num_shards == len(index.shards) == n
    assert index.shards == reference  # every field of every shard, extras included
    assert reference[:50] == Index.from_json({**data, "shards": data["shards"][:50]}).shards
    assert index.shards[-1] == reference[-1] and index.shards[5] == reference[5]
    assert index.shards[10:20] == reference[10:20] and isinstance(index.shards[10:20], tuple)
    assert index.shards[99_990:] + index.shards[:2] == reference[99_990:] + reference[:2]
    assert index.to_json() == data
    assert index.fingerprint == _canonical_fingerprint(data)
    subset = {**data, "shards": data["shards"][:10_000]}  # built from ShardInfos, as the writer does
    assert Index(index.schema, reference[:10_000]).fingerprint == _canonical_fingerprint(subset)
    counts = [s.samples for s in reference]
    assert index.sample_offsets.tolist() == _reference_offsets(counts)
    assert index.num_samples == sum(counts)
    assert index.total_bytes == sum(s.bytes for s in reference)
    assert index.shard_samples.tolist() == counts
    assert index.shard_bytes.tolist() == [s.bytes for s in reference]
    assert set(index.formats) == {"arrow", "tar"}
    assert index.empty_shards().tolist() == [i for i, c in enumerate(counts) if c == 0]
    import bisect

    offsets = _reference_offsets(counts)
    rng = np.random.default_rng(1)
    samples = rng.integers(0, index.num_samples, 5000).tolist() + [0, index.num_samples - 1]
    shards, rows = index.locate_many(samples)
    for k, sample in enumerate(samples):
        shard = bisect.bisect_right(offsets, sample) - 1
        assert index.locate(sample) == (shard, sample - offsets[shard]) == (shards[k], rows[k])
        assert reference[shard].samples > 0
    with pytest.raises(IndexError, match="out of range"):
        index.locate(index.num_samples)
    with pytest.raises(IndexError, match="out of range"):
        index.shards[n]
    assert index.shards[-n] == reference[0]


def test_large_index_bytes_per_shard_are_bounded(large_index_json):
    import gc
    import pickle

    index = Index.from_json(large_index_json)
    n = index.num_shards
    assert index.nbytes <= 100 * n  # measured: about 77 (paths of 24 characters, 3 checksums)
    assert len(pickle.dumps(index)) <= 100 * n + 10_000  # what a spawned worker receives
    again = pickle.loads(pickle.dumps(index))
    assert again == index and again.fingerprint == index.fingerprint
    # The index is a few hundred Python objects here (a few dozen, plus the ids of the shards
    # that lack a field most have, or have one most lack), not several per shard as entries
    # once were: a forked worker's reference counting and garbage collector touch those only.
    seen: set[int] = set()
    todo = [index]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        todo.extend(gc.get_referents(obj))
    assert len(seen) < n / 100


def test_large_index_sample_counts_add_up_across_a_fork(large_index_json):
    """A forked process reads the parent's index (no copy is sent) and gets the same answers."""
    import multiprocessing

    index = Index.from_json(large_index_json)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply(_child_answers, (None,))
    assert got == _child_answers(index)


_FORKED: Index | None = None


def _child_answers(index: Index | None) -> tuple:
    index = index if index is not None else _FORKED
    assert index is not None
    return (index.fingerprint, index.num_samples, index.shards[12345].to_json(), index.locate(777_777))


@pytest.fixture(autouse=True)
def _forked_index(request, large_index_json):
    global _FORKED
    if request.node.name == "test_large_index_sample_counts_add_up_across_a_fork":
        _FORKED = Index.from_json(large_index_json)
    yield
    _FORKED = None


def test_unusual_entries_take_the_entry_by_entry_path(arrow_dataset):
    """Paths that normalise, upper-case digests, int subclasses: validated entry by entry, and
    kept exactly as that validation gives them."""
    data = load_index(arrow_dataset.path).to_json()
    data["shards"][0]["path"] = "./" + data["shards"][0]["path"]
    data["shards"][1]["checksum"] = data["shards"][1]["checksum"].upper().replace("XXH3_128", "xxh3_128")
    index = Index.from_json(data)
    assert index.shards[0].path == data["shards"][0]["path"][2:]
    assert index.shards[1].checksum == data["shards"][1]["checksum"]
    expected = json.loads(json.dumps(data))
    expected["shards"][0]["path"] = index.shards[0].path
    assert index.to_json() == expected
    assert index.fingerprint == _canonical_fingerprint(expected)


def test_damaged_entry_among_many_is_named(large_index_json):
    data = json.loads(json.dumps(large_index_json))
    data["shards"][54_321]["samples"] = -1
    with pytest.raises(DatasetIndexError, match=r"shards\[54321\]: field 'samples' must be a non-negative integer"):
        Index.from_json(data)
    data["shards"][54_321]["samples"] = 1
    data["shards"][60_000]["path"] = "../up.arrow"
    with pytest.raises(UnsafePathError, match=r"shards\[60000\].*escapes its root"):
        Index.from_json(data)
    data["shards"][60_000]["path"] = data["shards"][3]["path"]
    with pytest.raises(DatasetIndexError, match=r"shards\[60000\] repeats path .* \(also shards\[3\]\)"):
        Index.from_json(data)


def test_index_is_immutable(arrow_dataset):
    index = load_index(arrow_dataset.path)
    with pytest.raises(AttributeError):
        index.schema = {}  # type: ignore[misc]
    with pytest.raises(ValueError):
        index.sample_offsets[0] = 5


def test_large_index_file_loads_and_heap_is_trimmed(large_index_json, tmp_path):
    """`load_index` of a file over the trim threshold: the same index, then the heap trimmed."""
    from shardloader.source import index as source_index

    text = json.dumps(large_index_json)
    assert len(text) >= source_index._TRIM_BYTES
    (tmp_path / INDEX_NAME).write_text(text)
    loaded = load_index(str(tmp_path))
    assert loaded.fingerprint == _canonical_fingerprint(large_index_json)
    assert loaded.shards[777] == Index.from_json(large_index_json).shards[777]
    assert source_index.trim_heap() is True  # glibc (this project's CI and machines)
