"""An output directory (local path or fsspec URL) whose files appear atomically.

Local files are written to a hidden temporary name in the same directory, fsynced, then
renamed over the final name (and the directory fsynced), so a reader never sees a partial
file. For remote URLs, files are written to a local temporary directory and uploaded whole
(object stores make an uploaded object visible all at once), through the process's client of
`shardloader.io.clients`; uploads and lookups are retried on transient errors
(`shardloader.io.objects`: a whole-object put is safe to repeat).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Any

from shardloader.io.clients import filesystem
from shardloader.io.files import fsync_dir
from shardloader.io.objects import object_exists, put_file
from shardloader.io.paths import is_local, join_url, strip_file_scheme
from shardloader.io.retry import retrying


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
            self.fs, self.root = filesystem(url, storage_options, full_interface=True)
            retrying(lambda: self.fs.makedirs(self.root, exist_ok=True), url)
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
            put_file(self.fs, temp, self.final_path(name), join_url(self.url, name))
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
        return os.path.exists(path) if self.local else object_exists(self.fs, path, join_url(self.url, name))

    def remove(self, name: str) -> None:
        """Remove `name` if present."""
        path = self.final_path(name)
        if self.local:
            discard(path)
        elif self.exists(name):
            retrying(lambda: self.fs.rm_file(path), join_url(self.url, name))

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
