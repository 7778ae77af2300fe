"""The benchmark image set, generated once and cached under `benchmarks/out/` (git-ignored).

`prepare_images()` makes `n` procedural JPEGs (`shardloader.synthetic`, 128-256 px per side)
and stores the same bytes in the layouts the benchmarked loaders read:

* ``files/<class>/<i>.jpg``: one file per image (torch DataLoader over an image folder),
* ``arrow/``: shardloader's native Arrow shards plus ``index.json`` (fields image, label),
* ``tar/``: WebDataset tars (members ``<i:09d>.jpg`` and ``<i:09d>.cls``) plus ``index.json``,

and, on request from the peers benchmark (which runs in ``.venv-bench`` where those libraries
are installed), mosaicml-streaming's MDS and litdata's optimized format. Sample `i` has label
`i % 10` and carries its number as its id in every layout, so loaders can be compared by the
exact sequence of sample ids they deliver.

Each layout is written into a temporary directory and renamed into place with a ``done.json``
written last, so an interrupted run regenerates it and a finished one is reused.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shardloader.synthetic import class_name, make_image_samples

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
DEFAULT_N = 20_000
SAMPLES_PER_SHARD = 1_000
_CHUNK = 500


@dataclass(frozen=True)
class ImageSet:
    """Where one generated image set lives, and what it holds."""

    root: str
    n: int
    seed: int
    min_size: int
    max_size: int

    @property
    def files_dir(self) -> str:
        return os.path.join(self.root, "files")

    @property
    def arrow_dir(self) -> str:
        return os.path.join(self.root, "arrow")

    @property
    def tar_dir(self) -> str:
        return os.path.join(self.root, "tar")

    def layout_dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def file_path(self, i: int) -> str:
        return os.path.join(self.files_dir, class_name(i % 10), f"{i:06d}.jpg")

    def file_items(self) -> list[tuple[str, int]]:
        """(path, label) of every image, in sample order."""
        return [(self.file_path(i), i % 10) for i in range(self.n)]

    def tar_urls(self) -> list[str]:
        with open(os.path.join(self.tar_dir, "index.json")) as f:
            shards = json.load(f)["shards"]
        return [os.path.join(self.tar_dir, s["path"]) for s in shards]

    def read_jpeg(self, i: int) -> bytes:
        with open(self.file_path(i), "rb") as f:
            return f.read()

    def iter_samples(self) -> Iterator[tuple[int, bytes, int]]:
        """(id, jpeg bytes, label) in sample order, read from the files layout."""
        for i in range(self.n):
            yield i, self.read_jpeg(i), i % 10

    def nbytes(self) -> int:
        return sum(os.path.getsize(self.file_path(i)) for i in range(self.n))


def _chunk(args: tuple[int, int, int, int, int]) -> list[bytes]:
    start, count, seed, min_size, max_size = args
    return [s["image"] for s in make_image_samples(
        count, start=start, seed=seed, min_size=min_size, max_size=max_size)]


#: Bumped when shardloader's writer changes what it writes, so that shards written by an
#: older writer are rebuilt instead of measured. 2: shards carry range sidecars.
SHARDS_VERSION = 2


def _done(path: str, version: int = 1) -> bool:
    try:
        with open(os.path.join(path, "done.json")) as f:
            return json.load(f).get("version", 1) == version
    except (OSError, ValueError):
        return False


def _build(path: str, make: Callable[[str], None], what: str, log: Callable[[str], None],
           version: int = 1) -> None:
    """Run `make(tmp)` then rename tmp to `path` and mark it done (skipped when already done)."""
    if _done(path, version):
        return
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(tmp)
    start = time.perf_counter()
    make(tmp)
    with open(os.path.join(tmp, "done.json"), "w") as f:
        json.dump({"what": what, "seconds": time.perf_counter() - start,
                   "version": version}, f)
    os.rename(tmp, path)
    log(f"  wrote {what} in {time.perf_counter() - start:.1f} s: {path}")


def prepare_images(
    n: int = DEFAULT_N,
    *,
    seed: int = 0,
    min_size: int = 128,
    max_size: int = 256,
    out: str = OUT,
    log: Callable[[str], None] = print,
) -> ImageSet:
    """The image set of `n` JPEGs in the files, arrow and tar layouts (generated if missing)."""
    root = os.path.join(out, f"images-n{n}-seed{seed}-{min_size}-{max_size}")
    images = ImageSet(root, n, seed, min_size, max_size)
    os.makedirs(root, exist_ok=True)

    def make_files(tmp: str) -> None:
        jobs = [(s, min(_CHUNK, n - s), seed, min_size, max_size) for s in range(0, n, _CHUNK)]
        log(f"  generating {n} JPEGs ({min_size}-{max_size} px) ...")
        with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
            for (start, _, _, _, _), blobs in zip(jobs, pool.imap(_chunk, jobs)):
                for i, blob in enumerate(blobs, start):
                    folder = os.path.join(tmp, class_name(i % 10))
                    os.makedirs(folder, exist_ok=True)
                    with open(os.path.join(folder, f"{i:06d}.jpg"), "wb") as f:
                        f.write(blob)

    def make_arrow(tmp: str) -> None:
        from shardloader.ingest.writer import write_shards

        write_shards(({"image": b, "label": y} for _, b, y in images.iter_samples()), tmp,
                     shard_samples=SAMPLES_PER_SHARD, overwrite=True)

    def make_tar(tmp: str) -> None:
        from shardloader.ingest.writer import write_shards

        write_shards(({"__key__": f"{i:09d}", "jpg": b, "cls": y} for i, b, y in images.iter_samples()),
                     tmp, shard_samples=SAMPLES_PER_SHARD, format="tar", overwrite=True)

    _build(images.files_dir, make_files, f"{n} JPEG files", log)
    _build(images.arrow_dir, make_arrow, "Arrow shards", log, SHARDS_VERSION)
    _build(images.tar_dir, make_tar, "WebDataset tar shards", log, SHARDS_VERSION)
    return images


def prepare_mds(images: ImageSet, log: Callable[[str], None] = print) -> str:
    """The image set in mosaicml-streaming's MDS format (needs `streaming` installed)."""
    path = images.layout_dir("mds")

    def make(tmp: str) -> None:
        from benchmarks.peers import import_streaming

        MDSWriter = import_streaming().MDSWriter  # noqa: N806

        columns = {"id": "int", "jpg": "bytes", "cls": "int"}
        size_limit = max(1 << 20, images.nbytes() // max(1, images.n // SAMPLES_PER_SHARD))
        with MDSWriter(out=os.path.join(tmp, "data"), columns=columns, size_limit=size_limit) as w:
            for i, blob, label in images.iter_samples():
                w.write({"id": i, "jpg": blob, "cls": label})

    _build(path, make, "MDS shards", log)
    return os.path.join(path, "data")


def prepare_litdata(images: ImageSet, log: Callable[[str], None] = print) -> str:
    """The image set in litdata's optimized format (needs `litdata` installed)."""
    path = images.layout_dir("litdata")

    def make(tmp: str) -> None:
        from litdata.streaming.writer import BinaryWriter

        chunk_bytes = max(1 << 20, images.nbytes() // max(1, images.n // SAMPLES_PER_SHARD))
        writer = BinaryWriter(os.path.join(tmp, "data"), chunk_bytes=chunk_bytes)
        for i, blob, label in images.iter_samples():
            writer[i] = {"id": i, "jpg": blob, "cls": label}
        writer.done()
        writer.merge()

    _build(path, make, "litdata chunks", log)
    return os.path.join(path, "data")


def describe(images: ImageSet) -> str:
    mib = images.nbytes() / 2**20
    return (f"{images.n} synthetic JPEGs, {images.min_size}-{images.max_size} px per side, "
            f"{mib:.0f} MiB, {SAMPLES_PER_SHARD} per shard")


def imagenet_like_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """`n` JPEGs the size of ImageNet's average (350-420 px a side, ~110 KB): the procedural
    images (`shardloader.synthetic`) with pixel noise (sigma 8) for photo-like entropy, encoded
    at quality 97. The second implementations' benchmarks (issue 37) measure with these."""
    import numpy as np

    from shardloader.synthetic import encode_jpeg, make_image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        image, _ = make_image(i, min_size=350, max_size=420, seed=seed)
        noise = rng.normal(0, 8, image.shape).astype(np.int16)
        out.append(encode_jpeg(np.clip(image.astype(np.int16) + noise, 0, 255).astype(np.uint8), 97))
    return out
