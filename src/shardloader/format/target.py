"""An output directory (local path or fsspec URL) whose files appear atomically.

Local files are written to a hidden temporary name in the same directory, fsynced, then
renamed over the final name (and the directory fsynced), so a reader never sees a partial
file. For remote URLs, files are written to a local temporary directory and uploaded whole
(object stores make an uploaded object visible all at once).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Any

import fsspec

from shardloader.fileio import fsync_dir
from shardloader.source import is_local, strip_file_scheme


class OutputDir:
    """Files written into `url` appear whole or not at all."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.local = is_local(url)
        self._counter = itertools.count()
        if self.local:
            self.root = os.path.abspath(strip_file_scheme(url))
            os.makedirs(self.root, exist_ok=True)
            self._staging: str | None = None
        else:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
            self.fs.makedirs(self.root, exist_ok=True)
            self._staging = tempfile.mkdtemp(prefix="shardloader-out-")

    def final_path(self, name: str) -> str:
        return os.path.join(self.root, name) if self.local else f"{self.root.rstrip('/')}/{name}"

    def temp_path(self, name: str) -> str:
        """A local path to write `name` into before `commit`."""
        tag = f"{os.getpid()}-{next(self._counter)}"
        if self.local:
            return os.path.join(self.root, f".{name}.tmp-{tag}")
        assert self._staging is not None
        return os.path.join(self._staging, f"{tag}-{name}")

    def commit(self, temp: str, name: str) -> None:
        """Make the finished local file `temp` appear as `name` in the directory."""
        if self.local:
            with open(temp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(temp, self.final_path(name))
            fsync_dir(self.root)
        else:
            self.fs.put_file(temp, self.final_path(name))
            os.remove(temp)

    def write_bytes(self, name: str, data: bytes) -> None:
        temp = self.temp_path(name)
        try:
            with open(temp, "wb") as f:
                f.write(data)
            self.commit(temp, name)
        except BaseException:
            discard(temp)
            raise

    def exists(self, name: str) -> bool:
        path = self.final_path(name)
        return os.path.exists(path) if self.local else self.fs.exists(path)

    def remove(self, name: str) -> None:
        """Remove `name` if present."""
        path = self.final_path(name)
        if self.local:
            discard(path)
        elif self.fs.exists(path):
            self.fs.rm_file(path)

    def close(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def discard(path: str) -> None:
    """Remove a local file if it exists."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
