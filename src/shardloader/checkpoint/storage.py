"""Where checkpoints live: a local directory (with fsync) or any fsspec URL.

Both stores offer the same few operations the commit protocol needs: put a staged file into a
checkpoint directory, write the manifest atomically and last, list checkpoint directories, read
a file back while hashing it, and delete a checkpoint manifest-first (so a checkpoint being
deleted stops being complete before any of its data goes).

The local store moves staged files with `rename` when the staging directory is on the same
file system (no second copy) and otherwise copies them; it fsyncs files and directories so a
manifest never reaches the disk before the data it lists. Object stores (s3://, gs://, ...)
make an object visible only once it is whole, so the manifest object is the commit point.
The fsspec store retries transient errors of every call (5xx, 429, resets, timeouts) as the
shard cache does, through `shardloader.io.objects`.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardloader.checkpoint.manifest import MANIFEST_NAME, FileEntry, parse_id
from shardloader.errors import CheckpointError, FetchError
from shardloader.io import objects
from shardloader.io.checksum import new_hasher, parse_checksum
from shardloader.io.clients import filesystem
from shardloader.io.files import fsync_dir
from shardloader.io.paths import is_local, join_url, strip_file_scheme
from shardloader.io.retry import RetryPolicy, is_refusal, retrying

CHUNK = 8 << 20


class Store:
    """Operations on a checkpoint root. Paths passed in are relative to the root."""

    url: str

    def url_of(self, rel: str) -> str:
        return join_url(self.url, rel) if rel else self.url

    # -- listing -----------------------------------------------------------------------------
    def list_ids(self) -> list[str]:
        """Names of the checkpoint directories under the root (complete or not), unordered."""
        raise NotImplementedError

    def read_manifest_bytes(self, ckpt_id: str) -> bytes | None:
        """The manifest's bytes, or None when the checkpoint has no manifest (incomplete)."""
        raise NotImplementedError

    # -- writing -----------------------------------------------------------------------------
    def make_dir(self, ckpt_id: str, *, exist_ok: bool) -> None:
        raise NotImplementedError

    def put(self, local_path: str, ckpt_id: str, name: str, *, move: bool) -> None:
        """Place the staged file `local_path` at `<ckpt_id>/<name>` (moved when `move` allows)."""
        raise NotImplementedError

    def seal_dir(self, ckpt_id: str) -> None:
        """Make every file put into `ckpt_id` durable before the manifest is written."""

    def write_manifest(self, ckpt_id: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, ckpt_id: str) -> None:
        """Remove a checkpoint: its manifest first, then everything else."""
        raise NotImplementedError

    # -- small files beside the checkpoints (the job's records, `.job/`) ----------------------
    def read_small(self, rel: str) -> bytes | None:
        """The bytes of the small file `rel`, or None when it does not exist."""
        raise NotImplementedError

    def write_small(self, rel: str, data: bytes) -> None:
        """Write the small file `rel` whole (replacing it), making its directory."""
        raise NotImplementedError

    # -- reading -----------------------------------------------------------------------------
    def open(self, ckpt_id: str, name: str):
        """A binary file object of `<ckpt_id>/<name>`, read front to back (`read`, `readinto`)."""
        raise NotImplementedError

    def size(self, ckpt_id: str, name: str) -> int:
        raise NotImplementedError

    def checked_size(self, ckpt_id: str, name: str, entry: FileEntry) -> int:
        """The file's size; raise CheckpointError unless it exists with the manifest's size."""
        url = self.url_of(f"{ckpt_id}/{name}")
        try:
            size = self.size(ckpt_id, name)
        except FileNotFoundError:
            raise CheckpointError(f"{url}: file listed in the manifest is missing") from None
        if size != entry.bytes:
            raise CheckpointError(f"{url}: file is {size} bytes, the manifest records {entry.bytes}")
        return size

    @staticmethod
    def check_digest(url: str, algorithm: str, hasher: Any, entry: FileEntry) -> None:
        """Raise CheckpointError unless what `hasher` saw hashes to the manifest's checksum."""
        actual = f"{algorithm}:{hasher.hexdigest()}"
        if actual != entry.checksum:
            raise CheckpointError(f"{url}: checksum {actual} does not match the manifest ({entry.checksum})")

    def read_verified(self, ckpt_id: str, name: str, entry: FileEntry) -> torch.Tensor:
        """The file's bytes as a uint8 tensor, hashed while read; raise unless they match."""
        url = self.url_of(f"{ckpt_id}/{name}")
        self.checked_size(ckpt_id, name, entry)
        algorithm, _ = parse_checksum(entry.checksum)
        hasher = new_hasher(algorithm)
        buffer = torch.empty(entry.bytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        done = 0
        with self.open(ckpt_id, name) as f:
            while done < entry.bytes:
                n = f.readinto(view[done : done + CHUNK])
                if not n:
                    break
                hasher.update(view[done : done + n])
                done += n
        if done != entry.bytes:
            raise CheckpointError(f"{url}: read {done} bytes, the manifest records {entry.bytes}")
        self.check_digest(url, algorithm, hasher, entry)
        return buffer

    def verify(self, ckpt_id: str, name: str, entry: FileEntry) -> None:
        """Raise CheckpointError unless the file has the manifest's size and checksum."""
        self.checked_size(ckpt_id, name, entry)
        algorithm, _ = parse_checksum(entry.checksum)
        hasher = new_hasher(algorithm)
        with self.open(ckpt_id, name) as f:
            while chunk := f.read(CHUNK):
                hasher.update(chunk)
        self.check_digest(self.url_of(f"{ckpt_id}/{name}"), algorithm, hasher, entry)


class LocalStore(Store):
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(strip_file_scheme(root))
        self.url = self.root
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{self.root}: cannot create the checkpoint root: {exc}") from exc

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def list_ids(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [n for n in names if parse_id(n) is not None]

    def read_manifest_bytes(self, ckpt_id: str) -> bytes | None:
        try:
            with open(self._path(ckpt_id, MANIFEST_NAME), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def make_dir(self, ckpt_id: str, *, exist_ok: bool) -> None:
        os.makedirs(self._path(ckpt_id), exist_ok=exist_ok)
        fsync_dir(self.root)

    def put(self, local_path: str, ckpt_id: str, name: str, *, move: bool) -> None:
        dest = self._path(ckpt_id, name)
        if move:
            try:
                os.rename(local_path, dest)  # same file system: data already fsynced
                return
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
        tmp = dest + ".part"
        with open(local_path, "rb") as src, open(tmp, "xb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
            dst.flush()
            os.fsync(dst.fileno())
        os.rename(tmp, dest)

    def seal_dir(self, ckpt_id: str) -> None:
        fsync_dir(self._path(ckpt_id))

    def write_manifest(self, ckpt_id: str, data: bytes) -> None:
        final = self._path(ckpt_id, MANIFEST_NAME)
        tmp = final + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        fsync_dir(self._path(ckpt_id))

    def delete(self, ckpt_id: str) -> None:
        path = self._path(ckpt_id)
        try:
            os.unlink(os.path.join(path, MANIFEST_NAME))
            fsync_dir(path)
        except FileNotFoundError:
            pass
        shutil.rmtree(path, ignore_errors=False)
        fsync_dir(self.root)

    def read_small(self, rel: str) -> bytes | None:
        try:
            with open(self._path(rel), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_small(self, rel: str, data: bytes) -> None:
        final = self._path(rel)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = f"{final}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)

    def open(self, ckpt_id: str, name: str):
        return open(self._path(ckpt_id, name), "rb", buffering=0)

    def size(self, ckpt_id: str, name: str) -> int:
        return os.path.getsize(self._path(ckpt_id, name))

    def same_device(self, path: str) -> bool:
        try:
            return os.stat(path).st_dev == os.stat(self.root).st_dev
        except OSError:
            return False


class FsspecStore(Store):
    """Any fsspec file system. The manifest object is written last with a single PUT.

    Every call is retried on transient errors (5xx, 429, resets, timeouts) under `retry`, as
    the shard cache retries (`shardloader.io.objects`); each is safe to repeat whole: listings,
    sizes, reads (a stream from the offset it failed at), puts of a whole object, `makedirs`,
    deletes. A permanent error or exhausted retries raise FetchError naming the URL; a missing
    object is FileNotFoundError; a full or read-only destination raises its own OSError.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None, *,
                 retry: RetryPolicy | None = None) -> None:
        self.url = root.rstrip("/")
        self.retry = retry or RetryPolicy()
        try:
            self.fs, self.root = filesystem(self.url, storage_options, full_interface=True)
        except (ImportError, ValueError) as exc:
            raise CheckpointError(f"{root}: cannot open the checkpoint root: {exc}") from exc
        self.root = self.root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _at(self, rel: str) -> tuple[str, str]:
        """The client's path and the URL (for messages) of `rel` under the root."""
        return self._path(rel), self.url_of(rel)

    def list_ids(self) -> list[str]:
        try:  # a listing made now: fsspec's cached one is dropped first
            entries = objects.list_directory(self.fs, self.root, self.url, policy=self.retry)
        except FileNotFoundError:
            return []
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return [n for n in names if parse_id(n) is not None]

    def read_manifest_bytes(self, ckpt_id: str) -> bytes | None:
        try:
            return objects.read_object(self.fs, *self._at(f"{ckpt_id}/{MANIFEST_NAME}"),
                                       policy=self.retry)
        except FileNotFoundError:
            return None

    def make_dir(self, ckpt_id: str, *, exist_ok: bool) -> None:
        path, url = self._at(ckpt_id)
        with _refusals_unwrapped():
            if not exist_ok and objects.object_exists(self.fs, path, url, policy=self.retry):
                raise FileExistsError(errno.EEXIST, "checkpoint directory exists", url)
            # a no-op on object stores
            retrying(lambda: self.fs.makedirs(path, exist_ok=True), url, policy=self.retry)

    def put(self, local_path: str, ckpt_id: str, name: str, *, move: bool) -> None:
        remote, url = self._at(f"{ckpt_id}/{name}")
        with _refusals_unwrapped():
            objects.put_file(self.fs, local_path, remote, url, policy=self.retry)
        size = objects.object_size(self.fs, remote, url, policy=self.retry)  # asked anew
        expected = os.path.getsize(local_path)
        if size != expected:
            raise CheckpointError(f"{url}: uploaded {expected} bytes, the destination holds {size}")

    def write_manifest(self, ckpt_id: str, data: bytes) -> None:
        with _refusals_unwrapped():
            objects.put_bytes(self.fs, data, *self._at(f"{ckpt_id}/{MANIFEST_NAME}"),
                              policy=self.retry)

    def delete(self, ckpt_id: str) -> None:
        # FileNotFoundError: gone already, or deleted by an attempt whose answer was lost
        with _refusals_unwrapped():
            try:
                objects.remove_object(self.fs, *self._at(f"{ckpt_id}/{MANIFEST_NAME}"),
                                      policy=self.retry)
            except FileNotFoundError:
                pass
            try:
                objects.remove_object(self.fs, *self._at(ckpt_id), recursive=True,
                                      policy=self.retry)
            except FileNotFoundError:
                pass
        self.fs.invalidate_cache(self.root)

    def read_small(self, rel: str) -> bytes | None:
        try:
            return objects.read_object(self.fs, *self._at(rel), policy=self.retry)
        except FileNotFoundError:
            return None

    def write_small(self, rel: str, data: bytes) -> None:
        with _refusals_unwrapped():
            objects.put_bytes(self.fs, data, *self._at(rel), policy=self.retry)

    def open(self, ckpt_id: str, name: str) -> objects.RetryingReader:
        """The file read front to back; opening and each read are retried (a failed read is
        made again from the offset it started at)."""
        return objects.RetryingReader(self.fs, *self._at(f"{ckpt_id}/{name}"), block_size=CHUNK,
                                      policy=self.retry)

    def size(self, ckpt_id: str, name: str) -> int:
        return objects.object_size(self.fs, *self._at(f"{ckpt_id}/{name}"), policy=self.retry)


@contextmanager
def _refusals_unwrapped() -> Iterator[None]:
    """A write to a full or read-only destination raises the file system's own OSError
    (callers read its errno, as the local store's), not the FetchError made of it."""
    try:
        yield
    except FetchError as exc:
        if is_refusal(exc.__cause__):
            raise exc.__cause__ from None
        raise


def open_store(root: str, storage_options: dict[str, Any] | None = None, *,
               retry: RetryPolicy | None = None) -> Store:
    """A LocalStore for plain paths and file:// URLs, an FsspecStore (retrying transient
    errors under `retry`, default `RetryPolicy()`) for anything else."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"checkpoint root must be a path or URL string, got {type(root).__name__}")
    root = os.fspath(root)
    if is_local(root) and not storage_options:
        return LocalStore(root)
    return FsspecStore(root, storage_options, retry=retry)

