"""Verifying a dataset against its index: every shard (and sidecar) present, whole, intact.

`verify_dataset` recomputes every checksum by streaming each file once, and for local datasets
also opens every shard with its reader (sample count and schema against the index, and no null
values: every field of a shardloader dataset needs a value in every row). It returns
the problems found, each naming its file; an empty list means the dataset verifies. A malformed
or unsafe index raises (`DatasetIndexError`, `UnsafePathError`): there is nothing to check
against. A local shard or sidecar that leads out of the dataset root through a symbolic link
is a problem (the UnsafePathError's message, naming the link and its target) unless
`allow_links_outside_root`.

A remote dataset is read through the process's client of `shardloader.io.clients`, with the
shard cache's retries (`shardloader.io.objects`): transient errors (5xx, resets, timeouts) are
retried with backoff, and a permanent one other than a missing file (403, ...) raises FetchError
naming the URL, since no file can be checked then.

`unindexed_files` lists what lies beside the index without being named by it: shard and
sidecar files, a writer's hidden temporaries, an engine write's manifests (``_parts/``). Such
files do not change what the dataset holds (readers go by the index), so they are not problems;
they are what a killed or duplicated task left (`shardloader.ingest.parts`), and cost space.
"""

from __future__ import annotations

import os
import posixpath
import re
import warnings
from typing import Any

from tqdm.auto import tqdm

from shardloader.errors import ShardloaderError
from shardloader.format.index import Index, ShardInfo
from shardloader.format.ranges import RANGES_KEY
from shardloader.format.registry import FORMATS, open_shard, shard_format
from shardloader.format.tar import OFFSETS_KEY
from shardloader.io.checksum import checksum_file, format_checksum, new_hasher, parse_checksum
from shardloader.io.clients import filesystem
from shardloader.io.objects import list_directory, object_size, read_chunks
from shardloader.io.paths import (
    is_local,
    join_url,
    resolve_inside_root,
    safe_relative_path,
    strip_file_scheme,
)
from shardloader.source.index import load_index


def _check_file(fs: Any, url: str, size: int, checksum: str) -> str | None:
    """A problem with the file at `url` (missing, wrong size, wrong checksum), or None."""
    try:
        actual_size = object_size(fs, url, url)
    except FileNotFoundError:
        return f"{url}: missing"
    if actual_size != size:
        kind = "truncated" if actual_size < size else "larger than expected"
        return f"{url}: {actual_size} bytes but the index records {size} ({kind})"
    algorithm, _ = parse_checksum(checksum)
    if is_local(url):
        actual, _ = checksum_file(url, algorithm)
    else:
        hasher = new_hasher(algorithm)
        for chunk in read_chunks(fs, url, url, size):
            hasher.update(chunk)
        actual = format_checksum(algorithm, hasher.hexdigest())
    if actual != checksum:
        return f"{url}: checksum {actual} does not match the index ({checksum})"
    return None


def _check_links(root: str | None, relative: str, what: str) -> str | None:
    """The problem with a local file whose links lead out of `root`, or None (and None for a
    remote dataset or when links outside are allowed: `root` None)."""
    if root is None:
        return None
    try:
        resolve_inside_root(root, relative, what=what)
    except ShardloaderError as e:
        return str(e)
    return None


def _check_sidecar(fs: Any, root: str, shard: ShardInfo, key: str = OFFSETS_KEY,
                   link_root: str | None = None) -> str | None:
    """The problem with the sidecar the index entry describes under `key` (tar offsets, range
    sidecar), or None: its links (under `link_root`), size and checksum against the index, and
    a format's companion sidecar (a tar's offsets) parsed: every member it places in the tar."""
    entry = shard.extra.get(key)
    if entry is None:
        return None
    where = join_url(root, shard.path)
    if not isinstance(entry, dict) or not {"path", "bytes", "checksum"} <= entry.keys():
        return f"{where}: malformed '{key}' entry in the index: {entry!r}"
    try:
        relative = safe_relative_path(entry["path"], what=f"{where}: {key} sidecar")
        parse_checksum(str(entry["checksum"]))
    except (ShardloaderError, ValueError) as e:
        return str(e)
    url = join_url(root, relative)
    problem = (_check_links(link_root, relative, f"{where}: {key} sidecar")
               or _check_file(fs, url, entry["bytes"], entry["checksum"]))
    companion = shard_format(shard.format).companion
    if problem is None and companion is not None and companion.key == key:
        try:  # verified bytes, but written wrong (or forged with a matching checksum)
            data = b"".join(read_chunks(fs, url, url, entry["bytes"]))
            shard_format(shard.format).decode_companion(data, where=url)
        except ShardloaderError as e:
            return str(e)
    return problem


def _check_structure(root: str, shard: ShardInfo, index: Index) -> str | None:
    """Open a local shard with its reader: row count and schema against the index, no nulls."""
    path = os.path.join(root, shard.path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a bad sidecar is already reported
            reader = open_shard(shard, path, index.schema)
        try:
            nulls = reader.null_counts() if hasattr(reader, "null_counts") else {}
        finally:
            reader.close()
    except ShardloaderError as e:
        return str(e)
    if nulls:
        fields = ", ".join(f"field {name!r} ({count})" for name, count in nulls.items())
        return (f"{path}: null values in {fields}; every field needs a value in every row "
                "(reading such a row is an error)")
    return None


def verify_dataset(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
    progress: bool = False, allow_links_outside_root: bool = False,
) -> list[str]:
    """Every problem found in the dataset at `url`, one message per bad file; [] when it verifies.
    `progress` shows a progress bar (bytes checked) on stderr. A local shard or sidecar that is
    (or lies under) a symbolic link leading out of the root is a problem unless
    `allow_links_outside_root`."""
    url = os.fspath(url)
    index = load_index(url, storage_options)
    fs, _ = filesystem(url, storage_options, full_interface=True)
    root = strip_file_scheme(url) if is_local(url) else url
    link_root = root if is_local(url) and not allow_links_outside_root else None
    problems: list[str] = []
    bar = tqdm(total=index.total_bytes, desc=f"verifying {url}", unit="B", unit_scale=True,
               disable=not progress)
    with bar:
        for shard in index.shards:
            shard_problem = (
                _check_links(link_root, shard.path, f"shard {shard.path!r}")
                or _check_file(fs, join_url(root, shard.path), shard.bytes, shard.checksum))
            if shard_problem is None and is_local(url):
                shard_problem = _check_structure(root, shard, index)
            for problem in (shard_problem, _check_sidecar(fs, root, shard, link_root=link_root),
                            _check_sidecar(fs, root, shard, RANGES_KEY, link_root)):
                if problem is not None:
                    problems.append(problem)
            bar.update(shard.bytes)
    return problems


#: A writer's hidden temporary file (`shardloader.ingest.target.OutputDir.temp_path`).
_TEMPORARY = re.compile(r"\..+\.tmp-\d+-\d+")
_SIDECAR_SUFFIXES = (".idx", ".ranges")
_PARTS_DIR = "_parts"  # shardloader.ingest.parts.PARTS_DIR (that module imports this one)


def indexed_names(index: Index) -> set[str]:
    """Every file path the index names: its shards and their sidecars."""
    names = set()
    for shard in index.shards:
        names.add(shard.path)
        names.update(e["path"] for e in shard.extra.values() if isinstance(e, dict) and "path" in e)
    return names


def unindexed_files(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
                    index: Index | None = None) -> list[str]:
    """The URLs of files directly in the dataset root that look like shards, sidecars or a
    writer's temporaries but that the index does not name, and of manifests left in
    ``_parts/``; sorted. (`index`: the dataset's, when already loaded.)"""
    url = os.fspath(url)
    index = index if index is not None else load_index(url, storage_options)
    from shardloader.format.index_table import TABLE_NAME

    named = indexed_names(index) | {TABLE_NAME}
    suffixes = tuple(f.suffix for f in FORMATS.values()) + _SIDECAR_SUFFIXES
    found = []
    for folder, every in ((url, False), (join_url(url, _PARTS_DIR), True)):
        fs, root = filesystem(folder, storage_options, full_interface=True)
        try:
            entries = list_directory(fs, root, folder)
        except FileNotFoundError:
            continue
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if entry.get("type") != "file" or (not every and name in named):
                continue
            if every or name.endswith(suffixes) or _TEMPORARY.fullmatch(name):
                found.append(join_url(folder, name))
    return sorted(found)
