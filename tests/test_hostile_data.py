"""Hostile and oversized data (issue 25, items 10 and 11): sizes that data declares are checked
against a documented bound and against the bytes present before anything is allocated, and a
sample over 2 GiB is written (large_binary) or refused naming the sample and the field.

- an image header claiming 65000 x 65000 px, or more pixels than its JPEG bytes can hold;
- a ``.npy`` tar member whose header declares terabytes;
- an index whose sample counts overflow int64, or pass the bound;
- a tar offsets sidecar (its checksum matching the index) with a negative or out-of-range offset;
- a 2 GiB binary value written to an Arrow shard (one slow test: ~2.3 GiB of memory at peak).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pyarrow as pa
import pytest
import simplejpeg
from PIL import Image

from shardloader import Dataset, write_shards
from shardloader.errors import DatasetIndexError, SchemaError
from shardloader.format import schema as schema_module
from shardloader.format.index import INDEX_NAME, MAX_SAMPLES
from shardloader.format.schema import ARROW_VALUE_LIMIT
from shardloader.format.tar import TarOffsets, offsets_entry
from shardloader.format.wds_decode import FieldDecodeError
from shardloader.ingest import writer as writer_module
from shardloader.ingest.verify import verify_dataset
from shardloader.transforms import DecodeCropFlip, DecodeImage, ImageDecodeError
from shardloader.transforms.image_size import (
    DEFAULT_MAX_IMAGE_PIXELS,
    MAX_PIXELS_ENV,
    oversize_problem,
)


# -- forged images -----------------------------------------------------------------------------
def forged_jpeg(height: int, width: int, frame_marker: int = 0xC0) -> bytes:
    """A real 16 x 16 JPEG (a few hundred bytes) whose frame header claims height x width."""
    data = bytearray(simplejpeg.encode_jpeg(np.zeros((16, 16, 3), np.uint8), quality=90))
    at = data.index(b"\xff\xc0")
    data[at + 1] = frame_marker
    data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def forged_png(height: int, width: int) -> bytes:
    """A PNG whose IHDR claims height x width, with one row of pixel data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\0" * (3 * width + 1))) + chunk(b"IEND", b""))


def _run_capped(code: str, *, address_space: int = 4 << 30) -> list[dict]:
    """Run `code` in a child Python whose address space is capped (RLIMIT_AS): what decoding a
    forged header used to allocate (11.8 GiB) fails there at once instead of taking the
    machine's memory. The child prints one JSON object a line; they are returned."""
    prelude = textwrap.dedent(f"""
        import json, resource
        resource.setrlimit(resource.RLIMIT_AS, ({address_space}, {address_space}))
        def report(what, call):
            try:
                out = call()
                result = {{"what": what, "ok": True, "shape": list(out["image"].shape)}}
            except BaseException as e:
                result = {{"what": what, "ok": False, "type": type(e).__name__, "message": str(e)}}
            print(json.dumps(result), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture()
def bomb_dataset(tmp_path):
    """An Arrow dataset of images: a forged 65000 x 65000 JPEG (634 bytes), a forged PNG of the
    same size, a JPEG claiming 10000 x 10000 px in its few hundred bytes, and a real image."""
    real = simplejpeg.encode_jpeg(np.full((32, 48, 3), 200, np.uint8), quality=90)
    samples = [{"image": forged_jpeg(65000, 65000)}, {"image": forged_png(65000, 65000)},
               {"image": forged_jpeg(10000, 10000)}, {"image": real}]
    write_shards(samples, tmp_path / "ds")
    return str(tmp_path / "ds")


def test_an_image_header_claiming_65000_square_is_refused_before_decoding(bomb_dataset):
    results = _run_capped(f"""
        from shardloader import Dataset
        from shardloader.transforms import DecodeCropFlip, DecodeImage
        ds = Dataset({bomb_dataset!r})
        for i in range(4):
            report(f"DecodeImage {{i}}", lambda: DecodeImage()(ds[i]))
            report(f"DecodeCropFlip {{i}}", lambda: DecodeCropFlip(24)(ds[i]))
    """)
    by = {r["what"]: r for r in results}
    for name in ("DecodeImage", "DecodeCropFlip"):
        for i in (0, 1):  # the JPEG, the PNG: more pixels than the maximum
            r = by[f"{name} {i}"]
            assert not r["ok"] and r["type"] == "ImageDecodeError", r
            assert f"field 'image' of sample __index__={i}: not decoded" in r["message"]
            assert "65000 x 65000 = 4,225,000,000 pixels" in r["message"]
            assert f"max_pixels={DEFAULT_MAX_IMAGE_PIXELS:,}" in r["message"]
            assert "11.8 GiB" in r["message"] and MAX_PIXELS_ENV in r["message"]
        r = by[f"{name} 2"]  # within the maximum, but not in so few bytes
        assert not r["ok"] and r["type"] == "ImageDecodeError", r
        assert "10000 x 10000 = 100,000,000 pixels" in r["message"]
        assert "truncated or forged" in r["message"]
        assert by[f"{name} 3"]["ok"], by[f"{name} 3"]
    assert by["DecodeImage 3"]["shape"] == [32, 48, 3]


def test_the_pixel_maximum_is_configurable():
    real = simplejpeg.encode_jpeg(np.full((32, 48, 3), 200, np.uint8), quality=90)
    sample = {"image": real, "__index__": 7}
    with pytest.raises(ImageDecodeError, match=r"sample __index__=7: not decoded: .*48 x 32 = "
                                               r"1,536 pixels, more than max_pixels=1,000"):
        DecodeImage(max_pixels=1000)(sample)
    with pytest.raises(ImageDecodeError, match="max_pixels=1,000"):
        DecodeCropFlip(8, max_pixels=1000)(sample)
    assert DecodeImage(max_pixels=2000)(sample)["image"].shape == (32, 48, 3)
    with pytest.raises(ValueError, match="DecodeImage: max_pixels must be a positive int"):
        DecodeImage(max_pixels=0)


@pytest.mark.parametrize("fmt, options", [("PNG", {}), ("GIF", {}), ("BMP", {}), ("WEBP", {}),
                                          ("WEBP", {"lossless": True}), ("TIFF", {})])
def test_every_format_is_measured_before_decoding(fmt, options):
    """Each format's header gives the size (PNG, GIF, BMP, WebP at fixed offsets; TIFF through
    PIL's lazy open): a 53 x 37 image is refused under max_pixels=1000 and decoded under 2000."""
    buf = io.BytesIO()
    Image.fromarray(np.full((37, 53, 3), 90, np.uint8)).save(buf, fmt, **options)
    sample = {"image": buf.getvalue(), "__key__": "k"}
    with pytest.raises(ImageDecodeError, match="53 x 37 = 1,961 pixels, more than max_pixels=1,000"):
        DecodeImage(max_pixels=1000)(sample)
    assert DecodeImage(max_pixels=2000)(sample)["image"].shape == (37, 53, 3)
    assert DecodeCropFlip(8, max_pixels=2000)(sample)["image"].shape == (8, 8, 3)


def test_the_pixel_maximum_comes_from_the_environment(monkeypatch):
    real = simplejpeg.encode_jpeg(np.full((32, 48, 3), 200, np.uint8), quality=90)
    monkeypatch.setenv(MAX_PIXELS_ENV, "1000")
    with pytest.raises(ImageDecodeError, match="more than max_pixels=1,000"):
        DecodeImage()({"image": real})
    monkeypatch.setenv(MAX_PIXELS_ENV, "lots")
    with pytest.raises(ValueError, match=f"{MAX_PIXELS_ENV}='lots' must be a positive"):
        DecodeCropFlip(8)


def test_dense_but_real_jpegs_are_not_refused():
    """The bytes check allows what real JPEGs hold: a blank 4000 x 4000 image with optimised
    tables (the densest measured, 256 px per byte), baseline and progressive; an
    arithmetic-coded JPEG is not held to it (it may be denser)."""
    for progressive in (False, True):
        buf = io.BytesIO()
        Image.new("L", (4000, 4000), 255).save(buf, "JPEG", optimize=True, progressive=progressive)
        assert DecodeImage(mode="L")({"image": buf.getvalue()})["image"].shape == (4000, 4000, 1)
    huffman, arithmetic = forged_jpeg(2000, 2000), forged_jpeg(2000, 2000, frame_marker=0xC9)
    assert "truncated or forged" in oversize_problem(memoryview(huffman), DEFAULT_MAX_IMAGE_PIXELS)
    assert oversize_problem(memoryview(arithmetic), DEFAULT_MAX_IMAGE_PIXELS) is None


# -- a .npy member declaring terabytes ---------------------------------------------------------
def _npy_claiming(shape: tuple[int, ...], payload: bytes) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return buf.getvalue() + payload


def test_an_npy_member_declaring_terabytes_is_refused_before_allocating(tmp_path):
    good = io.BytesIO()
    np.save(good, np.arange(4.0))
    records = [{"__key__": "a", "arr.npy": good.getvalue()},
               {"__key__": "b", "arr.npy": _npy_claiming((2**40,), b"\0" * 32)},
               {"__key__": "c", "arr.npy": _npy_claiming((5,), b"\0" * 32)}]
    write_shards(records, tmp_path / "ds", format="tar")
    ds = Dataset(tmp_path / "ds")
    np.testing.assert_array_equal(ds[0]["arr.npy"], np.arange(4.0))
    with pytest.raises(FieldDecodeError, match=r"shard-00000.tar: sample 'b' field 'arr.npy': .*"
                       r"its header declares shape \(1099511627776,\) of float64, "
                       r"8,796,093,022,208 bytes, but only 32 bytes follow the header"):
        ds[1]
    with pytest.raises(FieldDecodeError, match=r"sample 'c' .*shape \(5,\) of float64, 40 bytes, "
                                               r"but only 32"):
        ds[2]


# -- index counts ------------------------------------------------------------------------------
def _edit_index(root: str, edit) -> None:
    path = os.path.join(root, INDEX_NAME)
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.fixture()
def two_shards(tmp_path):
    root = str(tmp_path / "ds")
    write_shards([{"x": i} for i in range(10)], root, shard_samples=5)
    return root


def test_an_index_whose_counts_overflow_is_a_clear_error(two_shards):
    def overflow(data):  # each fits int64, their sum does not
        for shard in data["shards"]:
            shard["samples"] = 2**62
    _edit_index(two_shards, overflow)
    with pytest.raises(DatasetIndexError, match=r"index.json: shards\[0\]: field 'samples' is "
                       r"4611686018427387904, more than the 281474976710656 any shard may hold "
                       r"\(shardloader.format.index.MAX_SAMPLES\): the index is damaged"):
        len(Dataset(two_shards))


def test_an_index_whose_total_passes_the_bound_is_a_clear_error(two_shards):
    def absurd(data):  # each shard within the bound, the dataset not
        for shard in data["shards"]:
            shard["samples"] = MAX_SAMPLES // 2 + 1
    _edit_index(two_shards, absurd)
    with pytest.raises(DatasetIndexError, match=r"index.json: the shards' 'samples' fields add up "
                       rf"to {MAX_SAMPLES + 2}, more than the {MAX_SAMPLES} a dataset may hold"):
        Dataset(two_shards)


def test_an_index_with_absurd_shard_bytes_is_a_clear_error(two_shards):
    _edit_index(two_shards, lambda data: data["shards"][1].update(bytes=2**70))
    with pytest.raises(DatasetIndexError, match=r"shards\[1\]: field 'bytes' is 1180591620717411303424"
                                                r", more than the 4611686018427387904"):
        Dataset(two_shards)


# -- tar offsets sidecars ----------------------------------------------------------------------
@pytest.mark.parametrize("offset", [-100, 10**6])
def test_a_sidecar_offset_outside_the_tar_is_named_and_the_tar_scanned(tmp_path, offset):
    root = str(tmp_path / "ds")
    records = [{"__key__": f"k{i}", "a.txt": f"hello {i}"} for i in range(6)]
    write_shards(records, root, shard_samples=3, format="tar")
    with open(os.path.join(root, INDEX_NAME)) as f:
        entry = json.load(f)["shards"][0]["offsets"]
    sidecar = os.path.join(root, entry["path"])
    with open(sidecar, "rb") as f:
        table = TarOffsets.decode(f.read(), where=sidecar)
    spans = table.spans.copy()
    spans[1, 0, 0] = offset
    forged = TarOffsets(table.keys, table.fields, spans, table.tar_bytes).encode()
    with open(sidecar, "wb") as f:
        f.write(forged)
    # the index describes the forged sidecar: its size and checksum verify
    _edit_index(root, lambda data: data["shards"][0].update(offsets=offsets_entry(entry["path"], forged)))

    expected = (rf"shard-00000.tar.idx: sample 'k1' field 'a.txt': the sidecar puts the member at "
                rf"offset {offset} \(7 bytes\), outside the tar's 10240 bytes; the offsets sidecar "
                r"is damaged")
    with pytest.warns(UserWarning, match=expected + "; scanning the tar headers instead"):
        ds = Dataset(root)
        rows = [ds[i]["a.txt"] for i in range(6)]
    assert rows == [f"hello {i}" for i in range(6)]
    problems = verify_dataset(root)
    assert len(problems) == 1 and problems[0].startswith(os.path.join(root, "shard-00000.tar.idx"))
    assert "the sidecar puts the member at" in problems[0]


# -- samples over 2 GiB at write time ----------------------------------------------------------
def _column_types(root: str, index, field: str = "data") -> list[str]:
    """Each shard's Arrow type of `field`."""
    out = []
    for shard in index.shards:
        with pa.memory_map(os.path.join(root, shard.path)) as f:
            out.append(str(pa.ipc.open_file(f).schema.field(field).type))
    return out


def test_values_over_the_arrow_limit_get_a_large_column(tmp_path, monkeypatch):
    """The routing of values too large for a 32-bit-offset column, with the limit lowered to 1000
    bytes so that it runs in milliseconds (the slow test below writes a real 2 GiB value)."""
    monkeypatch.setattr(schema_module, "ARROW_VALUE_LIMIT", 1000)
    monkeypatch.setattr(writer_module, "ARROW_VALUE_LIMIT", 1000)
    samples = [{"data": b"a" * 10, "text": "x"}, {"data": b"b" * 1500, "text": "y"},
               {"data": b"c" * 10, "text": "z" * 300}, {"data": b"d" * 1200, "text": "w"}]
    root = str(tmp_path / "ds")
    index = write_shards(samples, root, shard_bytes=1 << 20)
    # A shard's column types come from its first sample: the 1500-byte value starts a shard
    # with a large "data" column; 300 characters may be 1200 UTF-8 bytes, so sample 2 needs a
    # large "text" column and starts another, and sample 3 a large "data" one again.
    assert [s.samples for s in index.shards] == [1, 1, 1, 1]
    assert _column_types(root, index) == ["binary", "large_binary", "binary", "large_binary"]
    assert _column_types(root, index, "text") == ["string", "string", "large_string", "string"]
    assert index.schema == {"data": "binary", "text": "string"}
    ds = Dataset(root)
    assert [{k: ds[i][k] for k in ("data", "text")} for i in range(4)] == samples
    assert verify_dataset(root) == []


def test_a_struct_value_over_2_gib_is_refused_naming_sample_and_field(tmp_path):
    """pyarrow refuses the struct's child before copying it: this needs no 2 GiB of memory (the
    value is calloc'ed zeros, never touched)."""
    big = bytes(ARROW_VALUE_LIMIT + 2)
    samples = [{"image": {"bytes": b"a", "path": "a.jpg"}}, {"image": {"bytes": big, "path": "b.jpg"}}]
    with pytest.raises(SchemaError, match=r"sample 1: field 'image' \(struct<bytes: binary, path: "
                                          r"string>\) holds 2,147,483,653 bytes, more than an Arrow "
                                          r"column of that type can hold \(2,147,483,646 bytes"):
        write_shards(samples, tmp_path / "ds")
    assert not os.path.exists(tmp_path / "ds" / INDEX_NAME)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_a_sample_over_2_gib_is_written_and_read_back(tmp_path):
    """BIG: a real 2,147,483,647-byte value (~2.3 GiB of memory at peak, 2 GiB of disk, ~30 s).
    Written as large_binary in a shard of its own and read back whole (in two preads: one
    returns at most 0x7ffff000 bytes)."""
    if _mem_available() < 6 << 30 or shutil.disk_usage(tmp_path).free < 6 << 30:
        pytest.skip("needs 6 GiB of free memory and of disk")
    big = bytes(ARROW_VALUE_LIMIT + 1)  # calloc'ed: no memory until pyarrow copies it
    root = str(tmp_path / "ds")
    index = write_shards([{"data": b"first", "label": 0}, {"data": big, "label": 1},
                          {"data": b"last", "label": 2}], root)
    assert [s.samples for s in index.shards] == [1, 1, 1]
    assert _column_types(root, index) == ["binary", "large_binary", "binary"]
    ds = Dataset(root)
    assert ds[0]["data"] == b"first" and ds[2]["data"] == b"last"
    row = ds[1]
    assert row["label"] == 1 and len(row["data"]) == len(big) and row["data"] == big
    del row
    ds.close()
    assert verify_dataset(root) == []
