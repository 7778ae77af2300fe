"""WebDataset tar shards: round trips, webdataset interop, offsets sidecars, unsafe members."""

from __future__ import annotations

import dataclasses
import glob
import io
import os
import tarfile

import pytest
import webdataset as wds

from shardloader import Dataset, write_shards
from shardloader.errors import SchemaError, ShardError, UnsafePathError
from shardloader.format.tar import TarShardReader, scan_tar, sidecar_path, split_member_name
from shardloader.format.tar_writer import TarShardWriter
from shardloader.ingest.indexer import index_dataset
from tests.fixtures.data import copy_dataset, make_samples


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "__index__"}


def _write_tar(path, members) -> None:
    """A tar with (name, bytes) regular members, or prepared TarInfo objects."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tf.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_round_trip_every_sample(tar_dataset):
    ds = Dataset(tar_dataset)
    assert len(ds) == 150 and ds.index.num_shards == 3
    assert dict(ds.index.schema) == {"data": "binary", "label": "binary", "name": "binary"}
    assert [_strip(ds[i]) for i in range(len(ds))] == tar_dataset.samples
    rows = [149, 0, 77, 77, 3, 100]
    assert [_strip(r) for r in ds.get_many(rows)] == [tar_dataset.samples[i] for i in rows]


def test_our_tars_read_by_webdataset(tar_dataset):
    urls = sorted(glob.glob(os.path.join(tar_dataset.path, "*.tar")))
    got = [
        {k: v for k, v in s.items() if k not in ("__url__", "__local_path__")}
        for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    ]
    assert got == tar_dataset.samples


def test_webdataset_written_tars_read_by_us(tmp_path):
    samples = make_samples(45, seed=7)
    expected = []
    with wds.ShardWriter(str(tmp_path / "wds-%04d.tar"), maxcount=20) as sink:
        for i, s in enumerate(samples):
            record = {"__key__": f"k{i:04d}", "bin": s["data"], "txt": s["name"], "cls": s["label"]}
            sink.write(record)
            expected.append({"__key__": f"k{i:04d}", "bin": s["data"],
                             "txt": s["name"].encode(), "cls": str(s["label"]).encode()})
    decoded = [{**e, "txt": s["name"], "cls": s["label"]} for e, s in zip(expected, samples)]
    index = index_dataset(str(tmp_path))
    assert [s.samples for s in index.shards] == [20, 20, 5]
    assert [s.path for s in index.shards] == ["wds-0000.tar", "wds-0001.tar", "wds-0002.tar"]
    ds = Dataset(tmp_path)  # .txt and .cls members decode as webdataset decodes them
    assert [_strip(ds[i]) for i in range(len(ds))] == decoded
    raw = Dataset(tmp_path, decode=False)
    assert [_strip(raw[i]) for i in range(len(raw))] == expected
    with wds.TarWriter(str(tmp_path / "single.tar")) as sink:  # TarWriter directly, too
        sink.write({"__key__": "only", "jpg": b"\xff\xd8jpeg", "json": {"a": 1}})
    scanned = scan_tar(str(tmp_path / "single.tar"))
    assert scanned.keys == ["only"] and scanned.fields == ("jpg", "json")


def test_grouping_follows_webdataset_rule():
    assert split_member_name("a/b/0001.seg.PNG") == ("a/b/0001", "seg.png")
    assert split_member_name("dir.v2/x.jpg") == ("dir.v2/x", "jpg")
    assert split_member_name("README") is None
    assert split_member_name(".hidden") is None


def test_sidecar_used_and_scan_fallback_agree(tar_dataset, tmp_path):
    root = copy_dataset(tar_dataset, tmp_path)
    info = tar_dataset.index.shards[1]
    path = os.path.join(root, info.path)
    with TarShardReader(path, info) as reader:  # with the sidecar
        with_sidecar = reader.read_rows(range(len(reader)))
    os.remove(sidecar_path(path))
    with TarShardReader(path, info) as reader:  # header scan
        scanned = reader.read_rows(range(len(reader)))
    assert with_sidecar == scanned == tar_dataset.samples[50:100]


def test_bad_sidecar_warns_and_falls_back_to_scan(tar_dataset, tmp_path):
    root = copy_dataset(tar_dataset, tmp_path)
    info = tar_dataset.index.shards[0]
    path = os.path.join(root, info.path)
    with open(sidecar_path(path), "r+b") as f:
        f.seek(40)
        f.write(b"XXXX")
    with pytest.warns(UserWarning, match=r"shard-00000.tar.idx: sidecar does not match"):
        reader = TarShardReader(path, info)
    assert reader.read_rows([0, 49]) == [tar_dataset.samples[0], tar_dataset.samples[49]]
    reader.close()


def test_scan_is_checked_against_index_count(tar_dataset, tmp_path):
    root = copy_dataset(tar_dataset, tmp_path)
    info = tar_dataset.index.shards[0]
    os.remove(sidecar_path(os.path.join(root, info.path)))
    wrong = dataclasses.replace(info, samples=49)
    with pytest.raises(ShardError, match=r"shard-00000.tar: tar holds 50 samples but the index records 49"):
        TarShardReader(os.path.join(root, info.path), wrong)


@pytest.mark.parametrize("name", ["../escape.jpg", "/abs/x.jpg", "a/../../b.jpg"])
def test_unsafe_member_names(tmp_path, name):
    path = tmp_path / "bad.tar"
    _write_tar(path, [("ok.jpg", b"1"), (name, b"2")])
    with pytest.raises(UnsafePathError, match=rf"bad.tar: tar member '{name}'"):
        scan_tar(str(path))
    with pytest.raises(UnsafePathError, match="bad.tar"):
        index_dataset(str(tmp_path))


@pytest.mark.parametrize("kind,label", [
    (tarfile.SYMTYPE, "symbolic link"), (tarfile.LNKTYPE, "hard link"),
    (tarfile.CHRTYPE, "character device"), (tarfile.FIFOTYPE, "fifo"),
])
def test_links_and_devices_are_rejected(tmp_path, kind, label):
    member = tarfile.TarInfo("x.jpg")
    member.type = kind
    member.linkname = "target.jpg" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
    _write_tar(tmp_path / "links.tar", [("target.jpg", b"1"), member])
    with pytest.raises(ShardError, match=rf"links.tar: tar member 'x.jpg' is a {label}"):
        scan_tar(str(tmp_path / "links.tar"))


def test_truncated_tar(tar_dataset, tmp_path):
    root = copy_dataset(tar_dataset, tmp_path)
    info = tar_dataset.index.shards[2]
    path = os.path.join(root, info.path)
    os.remove(sidecar_path(path))
    last_data = int(scan_tar(path).spans[-1, 0, 0])
    with open(path, "r+b") as f:
        f.truncate(last_data + 1)  # inside the data of a member
    with pytest.raises(ShardError, match=rf"{path}: not a readable tar file .*unexpected end of data"):
        scan_tar(path)
    with pytest.raises(ShardError, match=rf"{info.path}.*truncated"):
        Dataset(root)[120]


def test_tar_truncated_at_member_boundary(tmp_path):
    path = tmp_path / "cut.tar"
    _write_tar(path, [("a.bin", b"x" * 600), ("b.bin", b"y" * 10)])
    # header(512) + data(1024) + header(512) + data(512): cut right after the first member
    with open(path, "r+b") as f:
        f.truncate(512 + 1024)
    with pytest.raises(ShardError, match=r"cut.tar: tar ends at byte 1536 without the end-of-archive marker"):
        scan_tar(str(path))


def test_corrupt_header_mid_tar(tmp_path):
    path = tmp_path / "corrupt.tar"
    _write_tar(path, [("a.bin", b"x" * 600), ("b.bin", b"y" * 10)])
    with open(path, "r+b") as f:
        f.seek(512 + 1024 + 148)  # the second header's checksum field
        f.write(b"99999999")
    with pytest.raises(ShardError, match=r"corrupt.tar: invalid tar header at byte 1536"):
        scan_tar(str(path))


def test_not_a_tar(tmp_path):
    path = tmp_path / "noise.tar"
    path.write_bytes(b"\x01" * 3000)
    with pytest.raises(ShardError, match="noise.tar: not a readable tar file"):
        scan_tar(str(path))


def test_duplicate_field_and_differing_fields(tmp_path):
    _write_tar(tmp_path / "dup.tar", [("a.jpg", b"1"), ("a.JPG", b"2")])
    with pytest.raises(ShardError, match=r"dup.tar: tar member 'a.JPG' repeats field 'jpg' of sample 'a'"):
        scan_tar(str(tmp_path / "dup.tar"))
    _write_tar(tmp_path / "mixed.tar", [("a.jpg", b"1"), ("a.cls", b"0"), ("b.jpg", b"2")])
    with pytest.raises(SchemaError, match=r"mixed.tar: sample 'b' has fields \['jpg'\]"):
        scan_tar(str(tmp_path / "mixed.tar"))


def test_skips_what_webdataset_skips(tmp_path):
    directory = tarfile.TarInfo("sub")
    directory.type = tarfile.DIRTYPE
    _write_tar(tmp_path / "skip.tar", [
        directory, ("__meta__", b"m"), ("README", b"no dot"), ("sub/a.jpg", b"1"), ("sub/b.jpg", b"2"),
    ])
    table = scan_tar(str(tmp_path / "skip.tar"))
    assert table.keys == ["sub/a", "sub/b"] and table.fields == ("jpg",)


def test_unicode_keys_and_fields(tmp_path):
    samples = [{"__key__": f"données/ñ-{i}", "légende": f"текст {i}", "data": bytes([i])} for i in range(5)]
    index = write_shards(samples, tmp_path / "ds", format="tar")
    assert dict(index.schema) == {"légende": "binary", "data": "binary"}
    ds = Dataset(tmp_path / "ds")
    assert [_strip(ds[i]) for i in range(5)] == [
        {"__key__": s["__key__"], "légende": s["légende"].encode(), "data": s["data"]} for s in samples
    ]
    got = list(wds.WebDataset(str(tmp_path / "ds" / "shard-00000.tar"), shardshuffle=False, empty_check=False))
    assert [g["__key__"] for g in got] == [s["__key__"] for s in samples]
    assert [g["légende"] for g in got] == [s["légende"].encode() for s in samples]


def test_writer_rejects_what_readers_would_misread(tmp_path):
    with TarShardWriter(str(tmp_path / "w.tar")) as writer:
        with pytest.raises(SchemaError, match="field 'JPG' cannot be a tar member extension"):
            writer.write({"__key__": "a", "JPG": b"1"})
        with pytest.raises(SchemaError, match=r"__key__ 'a.b'.*no dot"):
            writer.write({"__key__": "a.b", "jpg": b"1"})
        with pytest.raises(UnsafePathError, match="__key__: path '../a' escapes its root"):
            writer.write({"__key__": "../a", "jpg": b"1"})
        writer.write({"__key__": "a", "jpg": b"1"})
        with pytest.raises(SchemaError, match="repeats the previous sample's key"):
            writer.write({"__key__": "a", "jpg": b"2"})
        with pytest.raises(SchemaError, match=r"sample 'b' has fields \['jpg', 'txt'\] but the first sample has \['jpg'\]"):
            writer.write({"__key__": "b", "jpg": b"2", "txt": "x"})
        writer.write({"__key__": "b", "jpg": b"3"})
    with TarShardReader.unindexed(str(tmp_path / "w.tar")) as reader:  # rejected samples left no trace
        assert reader.read_rows([0, 1]) == [{"jpg": b"1", "__key__": "a"}, {"jpg": b"3", "__key__": "b"}]
    with pytest.raises(SchemaError, match="field 'Label' cannot be a tar member extension"):
        write_shards([{"Label": 1}], tmp_path / "ds", format="tar", schema={"Label": "int64"})
