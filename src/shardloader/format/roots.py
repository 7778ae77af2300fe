"""What to tell a user who passed something else where a dataset root is expected.

A dataset root is the folder that holds `index.json`. Users often pass the index file itself,
one shard, a folder of WebDataset tars or Parquet files not indexed yet, or a folder of images
not converted yet. `root_hint` looks at the path (its name, and for a local path what it holds)
and returns the sentence, with the command to run, that a "no index.json" error should carry.
It never raises and does no network I/O: a remote URL is judged by its name only.
`missing_index_message` is the whole error message.
"""

from __future__ import annotations

import os
import posixpath

from shardloader.format.index import INDEX_NAME
from shardloader.format.registry import FORMATS

SHARD_EXTENSIONS = tuple(f.suffix for f in FORMATS.values())
_COMPANION_NAMES = tuple(f.suffix + f.companion.suffix for f in FORMATS.values() if f.companion)
_INDEXABLE = tuple(f.suffix for f in FORMATS.values() if f.indexable)
# Image extensions torchvision's ImageFolder reads (kept equal to ingest.convert's list).
_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _parent(url: str) -> str:
    parent = posixpath.dirname(url.rstrip("/")) if "://" in url else os.path.dirname(url.rstrip("/"))
    return parent or "."


def _local(url: str) -> str | None:
    if "://" not in url:
        return url
    return url[len("file://"):] if url.startswith("file://") else None


def _holds_images(folder: str) -> bool:
    """True if `folder` or one of its direct subfolders holds an image file (a quick look)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return False
    for entry in entries:
        if entry.is_file() and entry.name.lower().endswith(_IMAGE_EXTENSIONS):
            return True
    for entry in entries[:1000]:
        if entry.is_dir():
            try:
                if any(e.name.lower().endswith(_IMAGE_EXTENSIONS) for e in os.scandir(entry.path)):
                    return True
            except OSError:
                continue
    return False


def missing_index_message(url: str, index_url: str) -> str:
    """The error message for "there is no `index_url` under dataset root `url`"."""
    hint = root_hint(url)
    local = _local(url)
    if hint and (url.rstrip("/").endswith((INDEX_NAME,) + SHARD_EXTENSIONS)
                 or (local is not None and os.path.isfile(local))):
        return f"{url}: not a dataset root{hint}"
    return f"{index_url}: no index.json found{hint}"


def root_hint(url: str) -> str:
    """A hint (" (...)") for a "no index.json at `url`" error, or "" when none fits."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    parent = _parent(url)
    if name == INDEX_NAME:
        return f" ({url} is the index file itself: pass the folder that holds it, {parent})"
    if name.lower().endswith(SHARD_EXTENSIONS + _COMPANION_NAMES):
        hint = f" ({url} is a shard file: pass the dataset folder that holds it and its index.json"
        if name.lower().endswith(_INDEXABLE):
            hint += (f"; to read a folder of .tar/.parquet files in place, index it first: "
                     f"`shardloader index {parent}`, or convert this file: "
                     f"`shardloader convert {url} OUT_DIR`")
        return hint + ")"
    local = _local(url)
    if local is None:
        return ""
    if os.path.isfile(local):
        return f" ({url} is a file: pass the dataset folder that holds index.json)"
    if not os.path.isdir(local):
        return ""
    try:
        names = os.listdir(local)
    except OSError:
        return ""
    if any(n.endswith(_INDEXABLE) for n in names):
        return f" (it holds .tar/.parquet files: run `shardloader index {url}` to index them in place)"
    if _holds_images(local):
        return (f" (it holds images: run `shardloader convert {url} OUT_DIR` to write shards, "
                "then pass OUT_DIR)")
    return ""
