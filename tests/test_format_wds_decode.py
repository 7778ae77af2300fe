"""WebDataset tar members decoded by extension (cls -> int, txt -> str, json -> parsed, npy ->
array), as webdataset's own decoding gives them; raw bytes one switch away; bad members named;
pickles never loaded."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch
import webdataset as wds

from shardloader import Dataset, Loader
from shardloader.format.wds_decode import FieldDecodeError, decode_record, decoded_fields
from shardloader.ingest.convert import convert
from shardloader.ingest.indexer import index_dataset
from tests.fixtures.data import _jpeg
from tests.resume import assert_same_samples


def _records(n: int, shard: int) -> list[dict]:
    rng = np.random.default_rng(shard)
    out = []
    for i in range(n):
        g = shard * 100 + i
        out.append({
            "__key__": f"s{shard}-{i:04d}",
            "jpg": _jpeg(rng, 8 + i % 3, 10),
            "cls": g % 7,  # TarWriter stores ints as their decimal text, as users' tars hold them
            "txt": f"caption {g} — ünïcode",
            "json": {"id": g, "tags": ["a", str(g)], "box": [0.5, 1.25]},
            "npy": np.arange(g % 5 + 1, dtype=np.int16),
            "seg.txt": f"segment {g}",
        })
    return out


@pytest.fixture(scope="module")
def wds_folder(tmp_path_factory):
    """Two tars written by webdataset's TarWriter, indexed in place."""
    root = tmp_path_factory.mktemp("wds") / "tars"
    root.mkdir()
    for shard in range(2):
        with wds.TarWriter(str(root / f"part-{shard}.tar")) as sink:
            for record in _records(12, shard):
                sink.write(record)
    index_dataset(str(root))
    return root


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("__index__", "__url__", "__local_path__")}


def test_decoded_like_webdataset_decode(wds_folder):
    urls = [str(wds_folder / f"part-{s}.tar") for s in range(2)]
    theirs = [_strip(s) for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode()]
    ds = Dataset(wds_folder)
    ours = [_strip(r) for r in ds.get_many(range(len(ds)))]
    assert len(ours) == len(theirs) == 24
    assert_same_samples(ours, theirs, "record", key_order=False)  # webdataset puts __key__ first
    first = ds[0]
    assert first["cls"] == 0 and type(first["cls"]) is int
    assert first["txt"] == "caption 0 — ünïcode" and first["seg.txt"] == "segment 0"
    assert first["json"] == {"id": 0, "tags": ["a", "0"], "box": [0.5, 1.25]}
    assert isinstance(first["jpg"], bytes) and first["jpg"][:3] == b"\xff\xd8\xff"  # for the transforms
    assert first["__key__"] == "s0-0000" and first["__index__"] == 0


def test_raw_bytes_one_switch_away(wds_folder):
    urls = [str(wds_folder / f"part-{s}.tar") for s in range(2)]
    theirs = [_strip(s) for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False)]
    raw = Dataset(wds_folder, decode=False)
    assert [_strip(r) for r in raw.get_many(range(24))] == theirs
    assert raw[3]["cls"] == b"3"
    only_cls = Dataset(wds_folder, decode=["cls"])
    record = only_cls[3]
    assert record["cls"] == 3 and record["txt"] == theirs[3]["txt"] and isinstance(record["json"], bytes)
    with pytest.raises(ValueError, match=r"fields \['label'\] that the dataset does not have"):
        Dataset(wds_folder, decode=["label"])


def _labels_only(sample: dict) -> dict:
    return {"cls": sample["cls"], "txt": sample["txt"], "__index__": sample["__index__"]}


@pytest.mark.parametrize("workers", [0, 2])
def test_cls_labels_collate_to_int_batches(wds_folder, workers):
    loader = Loader(Dataset(wds_folder), batch_size=8, shuffle=False, num_workers=workers,
                    transform=_labels_only)
    try:
        batches = list(loader)
    finally:
        loader.close()
    labels = torch.cat([b["cls"] for b in batches])
    assert labels.dtype == torch.int64
    assert labels.tolist() == [(s * 100 + i) % 7 for s in range(2) for i in range(12)]
    assert [t for b in batches for t in b["txt"]] == \
        [f"caption {s * 100 + i} — ünïcode" for s in range(2) for i in range(12)]


def test_decoding_is_deterministic_and_pure():
    fields = decoded_fields(["cls", "jpg", "meta.json", "x.npy", "pyd", "pth", "txt"], True)
    assert fields == {"cls": "cls", "meta.json": "json", "x.npy": "npy", "txt": "txt"}
    buf = io.BytesIO()
    np.save(buf, np.eye(2, dtype=np.float32))
    raw = {"__key__": "k", "cls": b" 12\n", "meta.json": b'{"a": [1, 2]}', "x.npy": buf.getvalue(),
           "txt": "é".encode(), "pyd": pickle.dumps({"x": 1}), "jpg": b"\xff\xd8\xff"}
    once = decode_record(dict(raw), fields, where="t.tar")
    twice = decode_record(dict(raw), fields, where="t.tar")
    assert once["cls"] == 12 and once["meta.json"] == {"a": [1, 2]} and once["txt"] == "é"
    assert np.array_equal(once["x.npy"], np.eye(2, dtype=np.float32)) and once["x.npy"].dtype == np.float32
    assert once["pyd"] == raw["pyd"] and once["jpg"] == raw["jpg"]  # pickles stay bytes (I12)
    assert {k: v for k, v in once.items() if k != "x.npy"} == {k: v for k, v in twice.items() if k != "x.npy"}


class _Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickled code ran')",))


def test_pickled_npy_is_refused_never_loaded():
    buf = io.BytesIO()
    np.save(buf, np.array([_Boom()], dtype=object), allow_pickle=True)
    with pytest.raises(FieldDecodeError, match=r"t.tar: sample 'k' field 'x.npy'.*without pickled objects"):
        decode_record({"__key__": "k", "x.npy": buf.getvalue()}, {"x.npy": "npy"}, where="t.tar")


@pytest.mark.parametrize("field, data, what", [
    ("cls", b"cat", "a decimal integer"),
    ("cls", b"", "a decimal integer"),
    ("txt", b"\xff\xfe", "UTF-8 text"),
    ("json", b"{'a': 1}", "JSON"),
])
def test_bad_member_is_named(tmp_path, field, data, what):
    root = tmp_path / "bad"
    root.mkdir()
    with wds.TarWriter(str(root / "p.tar")) as sink:
        sink.write({"__key__": "good", field: b"1" if field != "txt" else b"ok"})
        sink.write({"__key__": "broken", field: data})
    index_dataset(str(root))
    ds = Dataset(root)
    assert ds[0][field] in (1, "ok")
    with pytest.raises(FieldDecodeError) as info:
        ds[1]
    message = str(info.value)
    assert f"{root / 'p.tar'}: sample 'broken' field {field!r}" in message and what in message
    assert "decode=False" in message
    assert Dataset(root, decode=False)[1][field] == data


def test_convert_tar_stores_scalar_members_typed(wds_folder, tmp_path):
    convert(wds_folder, tmp_path / "arrow", progress=False, shuffle=False)
    ds = Dataset(tmp_path / "arrow")
    assert ds.index.schema["cls"] == "int64" and ds.index.schema["txt"] == "string"
    assert ds.index.schema["json"] == "binary" and ds.index.schema["jpg"] == "binary"
    tar = Dataset(wds_folder)
    for mine, theirs in zip(ds.get_many(range(24)), tar.get_many(range(24))):
        assert (mine["cls"], mine["txt"], mine["seg.txt"], mine["jpg"]) == \
            (theirs["cls"], theirs["txt"], theirs["seg.txt"], theirs["jpg"])
        assert json.loads(mine["json"]) == theirs["json"]
    # the indexed tar folder and the bare tar files convert the same way
    convert(wds_folder / "part-0.tar", tmp_path / "one", progress=False, shuffle=False)
    one = Dataset(tmp_path / "one").get_many(range(12))
    assert [r["cls"] for r in one] == [r["cls"] for r in ds.get_many(range(12))]
