"""Converting existing data into native shards (`shardloader convert`).

Sources, detected from `src` (a local path):

- an image-class folder ``SRC/<class>/<file>.jpg|png|...`` (torchvision's ImageFolder rule:
  the classes are the sorted subfolder names, labels 0..C-1 in that order; files in nested
  folders of a class count too; torchvision's image extensions): fields ``image`` (the file's
  bytes, not decoded), ``label``, ``class`` and ``filename`` (the path relative to SRC);
  samples in class order, then in torchvision's file order. A class folder without images is
  an error naming it unless `allow_empty`; an empty or undecodable image (header check) is an
  error naming the file, before any shard is kept;
- Parquet: a ``.parquet`` file or a folder of them (sorted by name), row by row, keeping types
  (struct columns too, such as Hugging Face's image ``struct<bytes: binary, path: string>``);
- WebDataset: a ``.tar`` file or a folder of them, one sample per key; fields with an integer
  or text extension (``cls``, ``txt``, ... see `shardloader.format.wds_decode`) are stored
  decoded as int64 and string, so they read back as `Dataset` gives them from the tar; every
  other field (images, ``json``, ``npy``) is stored as its bytes; ``__key__`` is kept as a
  string field;
- a shardloader dataset (a folder with ``index.json``), to re-shard it (tar shards as above).

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
from shardloader.format.registry import shard_format
from shardloader.format.rows import check_schema
from shardloader.format.schema import arrow_type, batch_records, schema_names
from shardloader.format.tar import TarShardReader
from shardloader.format.wds_decode import decode_record, extension, scalar_fields
from shardloader.ingest.writer import write_shards
from shardloader.io.paths import is_local, strip_file_scheme

# torchvision's IMG_EXTENSIONS, so that the same files become samples as with its ImageFolder.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_PARQUET_BATCH = 1024


@dataclass
class Source:
    """What `convert` reads: a kind, a sample count (when known upfront) and the samples."""

    kind: str
    samples: Callable[[], Iterator[dict[str, Any]]]
    count: int | None = None
    schema: dict[str, str] | None = None
    skipped: list[str] = field(default_factory=list)
    # Where the sample being yielded comes from ("file row 12"), kept up to date by `samples`
    # so that an error the writer raises about a sample can name the source file.
    where: list[str] = field(default_factory=lambda: [""])


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


def find_classes(root: str) -> list[str]:
    """The class names of an image-class folder: its subfolder names, sorted (torchvision's
    ImageFolder rule, hidden folders included, so labels match a torchvision-trained model)."""
    return sorted(entry.name for entry in os.scandir(root) if entry.is_dir())


def class_files(root: str, class_name: str) -> tuple[list[str], list[str]]:
    """(image files, other files) of one class folder, as paths relative to `root` with "/".

    Files are in torchvision's order: folders in sorted path order (the class folder first),
    files sorted by name within each; nested folders count. Symbolic links to folders are not
    followed (a link cycle would never end); links to files are read.
    """
    images: list[str] = []
    others: list[str] = []
    for folder, _, names in sorted(os.walk(os.path.join(root, class_name))):
        for file_name in sorted(names):
            relative = os.path.relpath(os.path.join(folder, file_name), root).replace(os.sep, "/")
            (images if file_name.lower().endswith(IMAGE_EXTENSIONS) else others).append(relative)
    return images, others


def image_folder_source(root: str, *, allow_empty: bool = False) -> Source:
    """Samples of an image-class folder (see module docstring).

    A class folder without images is a ShardloaderError naming it unless `allow_empty` (then
    its label is simply unused, as in torchvision). Each image is checked as it is read
    (`image_problem`: empty, or a header no decoder reads); the samples raise one
    ShardloaderError naming every bad file at the end, so nothing half-valid is written.
    """
    classes = find_classes(root)
    skipped = sorted(e.name for e in os.scandir(root) if e.is_file())
    files: list[tuple[int, str, str]] = []
    empty: list[str] = []
    for label, name in enumerate(classes):
        found, others = class_files(root, name)
        skipped += others
        if not found:
            empty.append(name)
        files += [(label, name, relative) for relative in found]
    extensions = "/".join(IMAGE_EXTENSIONS)
    if not classes:
        raise ShardloaderError(
            f"{root}: no class folders found (expected {root}/<class>/<image>, images ending "
            f"in {extensions})"
        )
    if empty and not allow_empty:
        shown = ", ".join(repr(os.path.join(root, n)) for n in empty[:10])
        more = f" and {len(empty) - 10} more" if len(empty) > 10 else ""
        raise ShardloaderError(
            f"{root}: class folder(s) {shown}{more} hold no images ({extensions}); labels are the "
            "positions of the sorted class folder names, so an empty one still takes a label. "
            "Remove it, or pass --allow-empty (allow_empty=True) to keep its label unused"
        )
    if not files:
        raise ShardloaderError(f"{root}: no class folders with {extensions} images found")

    def samples() -> Iterator[dict[str, Any]]:
        from shardloader.transforms.decode import image_problem

        bad: list[str] = []
        for label, name, relative in files:
            path = os.path.join(root, relative)
            source.where[0] = path
            with open(path, "rb") as f:
                image = f.read()
            problem = image_problem(image)
            if problem is not None:
                bad.append(f"{path}: {problem}")
                continue
            yield {"image": image, "label": label, "class": name, "filename": relative}
        if bad:
            more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
            raise ShardloaderError(
                f"{root}: {len(bad)} image file(s) cannot be decoded; fix or remove them "
                "(nothing was written):\n  " + "\n  ".join(bad[:20]) + more
            )

    source = Source("image-folder", samples, len(files),
                    {"image": "binary", "label": "int64", "class": "string", "filename": "string"},
                    skipped)
    return source


def _writable(schema: dict[str, str]) -> dict[str, str] | None:
    """`schema` if the writer can store every field type, else None (the writer then infers
    types and names the first value it cannot store)."""
    try:
        for type_name in schema.values():
            arrow_type(type_name)
    except SchemaError:
        return None
    return schema


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
    writable = _writable(schema)

    def samples() -> Iterator[dict[str, Any]]:
        for path in paths:
            row = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH):
                for record in batch_records(batch, np.arange(batch.num_rows)):
                    source.where[0] = f"{path} row {row}"
                    row += 1
                    yield record

    source = Source("parquet", samples, count, writable)
    return source


def tar_source(paths: list[str]) -> Source:
    """Samples of WebDataset tars, in file then member order, read by seeking."""

    def samples() -> Iterator[dict[str, Any]]:
        for path in paths:
            with TarShardReader.unindexed(path) as reader:
                decode = {f: extension(f) for f in scalar_fields(reader.fields)}
                for row in range(len(reader)):
                    record = reader.read(row)
                    source.where[0] = f"{path} sample {record.get('__key__')!r}"
                    yield decode_record(record, decode, where=path)

    source = Source("webdataset", samples)
    return source


def dataset_source(root: str) -> Source:
    """Samples of an existing shardloader dataset, to re-shard it, keeping the index's field
    types (a tar dataset's scalar fields are decoded, see the module docstring)."""
    from shardloader.dataset.sharded import Dataset
    from shardloader.source.index import load_index

    dataset = Dataset(root, decode=scalar_fields(load_index(root).schema))
    tar = any(shard_format(s.format).encoded_fields for s in dataset.index.shards)
    writable: dict[str, str] | None = None if tar else _writable(dict(dataset.index.schema))

    def samples() -> Iterator[dict[str, Any]]:
        for start in range(0, len(dataset), 256):
            for i, record in enumerate(dataset.get_many(range(start, min(start + 256, len(dataset))))):
                source.where[0] = f"{root} sample {start + i}"
                yield record
        dataset.close()

    source = Source("shardloader", samples, len(dataset), writable)
    return source


def detect_source(src: str, *, allow_empty: bool = False) -> Source:
    """The source at local path `src` (see module docstring), or ShardloaderError.
    `allow_empty` is passed to `image_folder_source`."""
    if os.path.isfile(src):
        if src.endswith(".parquet"):
            return parquet_source([src])
        if src.endswith(".tar"):
            return tar_source([src])
        folder = os.path.dirname(os.path.abspath(src))
        if os.path.basename(src) == INDEX_NAME or (
            src.endswith(".arrow") and os.path.exists(os.path.join(folder, INDEX_NAME))
        ):
            raise ShardloaderError(
                f"{src}: part of a shardloader dataset; to re-shard it, convert the dataset "
                f"folder: `shardloader convert {folder} DST`"
            )
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
    return image_folder_source(src, allow_empty=allow_empty)


def convert(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, progress: bool = True,
    allow_empty: bool = False, shuffle: bool = True, seed: int = 0, **writer_options: Any,
) -> dict[str, Any]:
    """Convert `src` into shards at `dst` with `write_shards(**writer_options)`.

    By default the samples are written in a seeded random order (`shuffle=True`, `seed`), each
    with its position in the source order in the int64 field ``source_index``: sources are
    usually sorted (an image folder class by class), and shards that each hold one class cannot
    be mixed by a loader that keeps only a few shards resident. `shuffle=False` keeps the source
    order. Shuffling a source read as a stream (Parquet, tars) first copies it to a temporary
    dataset next to `dst` (or in the system's temporary folder for a remote `dst`).

    `allow_empty`: an image folder may hold class folders without images (their labels stay
    unused); by default that is an error naming them. An error about one sample names the
    source file (and row or key) it came from.

    Returns a summary: source kind, samples, shards, bytes, fingerprint, seconds, the order
    (shuffled and seed), and the files skipped (image folders: files that are not images).
    """
    src, dst = os.fspath(src), os.fspath(dst)
    start = time.perf_counter()
    source = detect_source(src, allow_empty=allow_empty)
    if source.schema is not None:
        writer_options.setdefault("schema", source.schema)
        if writer_options.get("format") == "tar":
            for name, type_name in source.schema.items():
                if type_name.startswith("struct<"):
                    raise ShardloaderError(
                        f"{src}: field {name!r} is a {type_name}, which a tar member (one "
                        "encoded value) cannot hold; write Arrow shards (format 'arrow', the "
                        "default) to keep it"
                    )
    samples: Iterable[dict[str, Any]] = _Sized(source.samples, source.count)
    if shuffle:
        writer_options.update(shuffle=True, seed=seed)
        if is_local(dst):
            writer_options.setdefault("workdir", os.path.dirname(os.path.abspath(strip_file_scheme(dst))))
    try:
        index = write_shards(samples, dst, progress=progress, **writer_options)
    except SchemaError as e:  # about one sample: say which file it came from
        if not source.where[0]:
            raise
        raise type(e)(f"{source.where[0]}: {e}") from None
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
