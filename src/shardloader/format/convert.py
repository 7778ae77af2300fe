"""Converting existing data into native shards (`shardloader convert`).

Sources, detected from `src` (a local path):

- an image-class folder ``SRC/<class>/<file>.jpg|jpeg|png`` (files in nested folders of a class
  count too): fields ``image`` (the file's bytes, not decoded), ``label`` (the class's position
  among the sorted class folder names, as torchvision's ImageFolder numbers them), ``class``
  and ``filename`` (the path relative to SRC); samples in class order, then file path order;
- Parquet: a ``.parquet`` file or a folder of them (sorted by name), row by row, keeping types;
- WebDataset: a ``.tar`` file or a folder of them, one sample per key (fields are bytes, and
  ``__key__`` is kept as a string field);
- a shardloader dataset (a folder with ``index.json``), to re-shard it.

Samples stream through `write_shards`, so memory stays flat whatever the source size. They are
written in a seeded random order unless `shuffle=False` (see `convert`), with the source
position of each in the field ``source_index``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from shardloader.errors import SchemaError, ShardloaderError
from shardloader.format.index import INDEX_NAME
from shardloader.format.schema import arrow_type, batch_records, check_schema, schema_names
from shardloader.format.tar import TarShardReader
from shardloader.format.writer import write_shards
from shardloader.source import is_local, strip_file_scheme

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
_PARQUET_BATCH = 1024


@dataclass
class Source:
    """What `convert` reads: a kind, a sample count (when known upfront) and the samples."""

    kind: str
    samples: Callable[[], Iterator[dict[str, Any]]]
    count: int | None = None
    schema: dict[str, str] | None = None
    skipped: list[str] = field(default_factory=list)


class _Sized:
    """An iterable with a length, so the progress bar can show a total."""

    def __init__(self, make: Callable[[], Iterator[dict[str, Any]]], count: int | None) -> None:
        self._make, self._count = make, count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._make()

    def __len__(self) -> int:
        if self._count is None:
            raise TypeError("length unknown")
        return self._count


def image_folder_source(root: str) -> Source:
    """Samples of an image-class folder (see module docstring)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    files: list[tuple[int, str, str]] = []
    skipped: list[str] = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_file():
            skipped.append(entry.name)
    for label, name in enumerate(classes):
        class_dir = os.path.join(root, name)
        found = []
        for folder, dirs, names in os.walk(class_dir):
            dirs.sort()
            for file_name in names:
                relative = os.path.relpath(os.path.join(folder, file_name), root).replace(os.sep, "/")
                if file_name.lower().endswith(IMAGE_EXTENSIONS):
                    found.append(relative)
                else:
                    skipped.append(relative)
        files += [(label, name, relative) for relative in sorted(found)]
    if not files:
        raise ShardloaderError(f"{root}: no class folders with {'/'.join(IMAGE_EXTENSIONS)} images found")

    def samples() -> Iterator[dict[str, Any]]:
        for label, name, relative in files:
            with open(os.path.join(root, relative), "rb") as f:
                image = f.read()
            yield {"image": image, "label": label, "class": name, "filename": relative}

    return Source("image-folder", samples, len(files),
                  {"image": "binary", "label": "int64", "class": "string", "filename": "string"},
                  skipped)


def parquet_source(paths: list[str]) -> Source:
    """Rows of Parquet files, in file then row order; types kept when the writer can store them."""
    schema: dict[str, str] | None = None
    count = 0
    for path in paths:
        meta = pq.ParquetFile(path)
        names = schema_names(meta.schema_arrow)
        if schema is None:
            schema = names
        else:
            check_schema(names, schema, where=f"{path} and {paths[0]} have different schemas")
        count += meta.metadata.num_rows
    assert schema is not None
    try:
        for type_name in schema.values():
            arrow_type(type_name)
        writable: dict[str, str] | None = schema
    except SchemaError:
        writable = None  # let the writer name the first value it cannot store

    def samples() -> Iterator[dict[str, Any]]:
        for path in paths:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH):
                yield from batch_records(batch, np.arange(batch.num_rows))

    return Source("parquet", samples, count, writable)


def tar_source(paths: list[str]) -> Source:
    """Samples of WebDataset tars, in file then member order, read by seeking."""

    def samples() -> Iterator[dict[str, Any]]:
        for path in paths:
            with TarShardReader.unindexed(path) as reader:
                for row in range(len(reader)):
                    yield reader.read(row)

    return Source("webdataset", samples)


def dataset_source(root: str) -> Source:
    """Samples of an existing shardloader dataset, to re-shard it."""
    from shardloader.dataset import Dataset

    dataset = Dataset(root)

    def samples() -> Iterator[dict[str, Any]]:
        for start in range(0, len(dataset), 256):
            yield from dataset.get_many(range(start, min(start + 256, len(dataset))))
        dataset.close()

    return Source("shardloader", samples, len(dataset))


def detect_source(src: str) -> Source:
    """The source at local path `src` (see module docstring), or ShardloaderError."""
    if os.path.isfile(src):
        if src.endswith(".parquet"):
            return parquet_source([src])
        if src.endswith(".tar"):
            return tar_source([src])
        raise ShardloaderError(f"{src}: cannot convert this file (expected .parquet or .tar)")
    if not os.path.isdir(src):
        raise ShardloaderError(f"{src}: no such file or directory")
    if os.path.exists(os.path.join(src, INDEX_NAME)):
        return dataset_source(src)
    names = sorted(os.listdir(src))
    parquet = [os.path.join(src, n) for n in names if n.endswith(".parquet")]
    tars = [os.path.join(src, n) for n in names if n.endswith(".tar")]
    if parquet and tars:
        raise ShardloaderError(f"{src}: holds both .parquet and .tar files; convert them separately")
    if parquet:
        return parquet_source(parquet)
    if tars:
        return tar_source(tars)
    return image_folder_source(src)


def convert(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, progress: bool = True,
    shuffle: bool = True, seed: int = 0, **writer_options: Any,
) -> dict[str, Any]:
    """Convert `src` into shards at `dst` with `write_shards(**writer_options)`.

    By default the samples are written in a seeded random order (`shuffle=True`, `seed`), each
    with its position in the source order in the int64 field ``source_index``: sources are
    usually sorted (an image folder class by class), and shards that each hold one class cannot
    be mixed by a loader that keeps only a few shards resident. `shuffle=False` keeps the source
    order. Shuffling a source read as a stream (Parquet, tars) first copies it to a temporary
    dataset next to `dst` (or in the system's temporary folder for a remote `dst`).

    Returns a summary: source kind, samples, shards, bytes, fingerprint, seconds, the order
    (shuffled and seed), and the files skipped (image folders: files that are not images).
    """
    src, dst = os.fspath(src), os.fspath(dst)
    start = time.perf_counter()
    source = detect_source(src)
    if source.schema is not None:
        writer_options.setdefault("schema", source.schema)
    samples: Iterable[dict[str, Any]] = _Sized(source.samples, source.count)
    if shuffle:
        writer_options.update(shuffle=True, seed=seed)
        if is_local(dst):
            writer_options.setdefault("workdir", os.path.dirname(os.path.abspath(strip_file_scheme(dst))))
    index = write_shards(samples, dst, progress=progress, **writer_options)
    return {
        "source": src,
        "kind": source.kind,
        "destination": dst,
        "format": writer_options.get("format", "arrow"),
        "samples": index.num_samples,
        "shards": index.num_shards,
        "bytes": index.total_bytes,
        "fingerprint": index.fingerprint,
        "seconds": round(time.perf_counter() - start, 3),
        "shuffled": shuffle,
        "seed": seed if shuffle else None,
        "skipped": source.skipped,
    }
