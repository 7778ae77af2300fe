"""Hugging Face `datasets` image Parquet (image = struct<bytes: binary, path: string>): read in
place, decoded by the image transforms, and kept byte for byte by `shardloader convert`.

The files are built with pyarrow the way `datasets` writes them (its `Image` feature's storage
type and the ``huggingface`` schema metadata), without installing `datasets`."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from shardloader import Dataset, Loader
from shardloader.cli.main import main
from shardloader.errors import SchemaError, ShardloaderError
from shardloader.format.schema import arrow_type, parse_struct_type, type_name
from shardloader.ingest.convert import convert
from shardloader.ingest.indexer import index_dataset
from shardloader.transforms import (
    Compose,
    DecodeCropFlip,
    DecodeImage,
    ImageDecodeError,
    ToTensor,
    decode_image,
)

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
CLASSES = ["cat", "dog", "fox"]


def _encoded(rng: np.random.Generator, i: int) -> bytes:
    pixels = rng.integers(0, 256, size=(24 + 4 * (i % 5), 32 + 3 * (i % 7), 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG" if i % 4 == 3 else "JPEG", quality=90)
    return buf.getvalue()


def _hf_metadata() -> dict[bytes, bytes]:
    features = {"image": {"_type": "Image"},
                "label": {"names": CLASSES, "_type": "ClassLabel"}}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def write_hf_parquet(folder, n_files: int = 2, rows: int = 20, *, missing_bytes_at: int | None = None):
    """`n_files` Parquet files as `datasets` writes an image-classification split; returns the
    rows ({"image": {"bytes", "path"}, "label"}) in file order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    everything = []
    for f in range(n_files):
        records = []
        for r in range(rows):
            i = f * rows + r
            data = None if i == missing_bytes_at else _encoded(rng, i)
            path = f"/home/someone/raw/{CLASSES[i % 3]}/{i:04d}.jpg" if i % 2 else None
            records.append({"image": {"bytes": data, "path": path}, "label": i % 3})
        schema = pa.schema([("image", HF_IMAGE), ("label", pa.int64())], metadata=_hf_metadata())
        table = pa.Table.from_pylist(records, schema=schema)
        pq.write_table(table, folder / f"train-{f:05d}-of-{n_files:05d}.parquet", row_group_size=8)
        everything += records
    return everything


@pytest.fixture(scope="module")
def hf_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "data"
    rows = write_hf_parquet(root)
    index_dataset(str(root))
    return root, rows


def test_struct_type_names_round_trip():
    assert type_name(HF_IMAGE) == "struct<bytes: binary, path: string>"
    assert arrow_type("struct<bytes: binary, path: string>") == HF_IMAGE
    nested = "struct<a: struct<b: int16, c: array<float32>[2]>, d: string>"
    assert parse_struct_type(nested) == {"a": "struct<b: int16, c: array<float32>[2]>", "d": "string"}
    assert type_name(arrow_type(nested)) == nested
    with pytest.raises(SchemaError, match="malformed struct type"):
        arrow_type("struct<bytes binary>")


def test_hf_parquet_read_in_place_and_decoded(hf_dataset):
    root, rows = hf_dataset
    ds = Dataset(root)
    assert dict(ds.index.schema) == {"image": "struct<bytes: binary, path: string>", "label": "int64"}
    order = [37, 0, 8, 21, 39, 7]
    got = ds.get_many(order)
    assert [r["image"] for r in got] == [rows[i]["image"] for i in order]
    assert [r["label"] for r in got] == [rows[i]["label"] for i in order]
    decode = DecodeImage()
    for i, record in zip(order, got):
        image = decode(record)["image"]
        assert np.array_equal(image, decode_image(rows[i]["image"]["bytes"]))
    # DecodeCropFlip takes the struct too and draws exactly as it does from the bytes.
    crop = DecodeCropFlip(16)
    for i, record in zip(order, got):
        from_struct = crop(record, generator=torch.Generator().manual_seed(i))["image"]
        from_bytes = crop({"image": rows[i]["image"]["bytes"]},
                          generator=torch.Generator().manual_seed(i))["image"]
        assert from_struct.shape == (16, 16, 3) and np.array_equal(from_struct, from_bytes)
    ds.close()


def test_hf_parquet_through_the_loader(hf_dataset):
    root, rows = hf_dataset
    loader = Loader(Dataset(root), batch_size=8, shuffle=False, num_workers=0,
                    transform=Compose([DecodeCropFlip(16), ToTensor()]))
    batches = list(loader)
    assert [int(i) for b in batches for i in b["__index__"]] == list(range(len(rows)))
    assert all(b["image"].shape[1:] == (3, 16, 16) for b in batches)
    assert [int(x) for b in batches for x in b["label"]] == [r["label"] for r in rows]
    loader.close()


def test_hf_image_without_bytes_is_named_never_opened(tmp_path):
    rows = write_hf_parquet(tmp_path / "data", n_files=1, rows=4, missing_bytes_at=1)
    index_dataset(str(tmp_path / "data"))
    sample = Dataset(tmp_path / "data")[1]
    assert sample["image"] == {"bytes": None, "path": rows[1]["image"]["path"]}
    for transform in (DecodeImage(), DecodeCropFlip(8)):
        with pytest.raises(ImageDecodeError) as info:
            transform(sample)
        message = str(info.value)
        assert "field 'image' of sample __index__=1" in message
        assert "/home/someone/raw/dog/0001.jpg" in message and "never opens paths" in message
    with pytest.raises(ImageDecodeError, match="dict without 'bytes'"):
        DecodeImage()({"image": {"path": "x.jpg"}})


def test_hf_parquet_survives_convert(hf_dataset, tmp_path):
    root, rows = hf_dataset
    assert main(["convert", str(root), str(tmp_path / "arrow"), "--no-progress",
                 "--shard-samples", "16"]) == 0
    ds = Dataset(tmp_path / "arrow")
    assert dict(ds.index.schema) == {"image": "struct<bytes: binary, path: string>",
                                     "label": "int64", "source_index": "int64"}
    assert ds.index.num_shards == 3
    got = ds.get_many(range(len(rows)))
    # convert shuffles by default; source_index says which source row each sample is
    assert sorted(r["source_index"] for r in got) == list(range(len(rows)))
    assert [r["image"] for r in got] == [rows[r["source_index"]]["image"] for r in got]
    assert [r["label"] for r in got] == [rows[r["source_index"]]["label"] for r in got]
    # and converting the converted dataset again, in its order, keeps them too
    convert(tmp_path / "arrow", tmp_path / "again", progress=False, shuffle=False)
    again = Dataset(tmp_path / "again").get_many(range(len(rows)))
    assert [r["image"] for r in again] == [r["image"] for r in got]


def test_struct_column_to_tar_is_refused_naming_the_field(hf_dataset, tmp_path):
    root, _ = hf_dataset
    with pytest.raises(ShardloaderError, match=r"field 'image' is a struct<bytes: binary, path: string>"):
        convert(root, tmp_path / "tar", progress=False, format="tar")
    assert not (tmp_path / "tar").exists()


def test_convert_unstorable_value_names_the_file(tmp_path):
    table = pa.table({"x": pa.array([[1], [2, 3]], pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "lists.parquet")
    with pytest.raises(SchemaError) as info:
        convert(tmp_path / "lists.parquet", tmp_path / "out", progress=False)
    assert f"{tmp_path / 'lists.parquet'} row 0: sample 0: field 'x'" in str(info.value)
    assert not (tmp_path / "out" / "index.json").exists()


def test_write_shards_infers_struct_from_dicts(tmp_path):
    from shardloader.ingest.writer import write_shards

    samples = [{"image": {"bytes": bytes([i]) * 5, "path": f"{i}.jpg"}, "label": i} for i in range(5)]
    index = write_shards(samples, tmp_path / "ds")
    assert index.schema["image"] == "struct<bytes: binary, path: string>"
    assert [r["image"] for r in Dataset(tmp_path / "ds").get_many(range(5))] == \
        [s["image"] for s in samples]
    with pytest.raises(SchemaError, match=r"sample 1: field 'image' holds"):
        write_shards([samples[0], {"image": {"bytes": b"x"}, "label": 1}], tmp_path / "bad")
