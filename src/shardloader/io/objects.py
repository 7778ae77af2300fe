"""Listing, sizing, reading, putting and deleting remote objects, with the cache's retries.

The tools that work on a whole remote dataset (`verify`, `index`, output directories) and
checkpoint storage make calls the read path never makes: list a folder, ask an object's size,
read a whole small object or stream a large one once, upload a finished file, delete. Each
helper here makes one such call on a client of `shardloader.io.clients` under the rules of
`shardloader.io.retry`: transient errors (5xx, 429, resets, timeouts) are retried with the
same backoff and bounds as shard downloads; a missing object raises FileNotFoundError
unchanged (callers say what is missing); any other permanent error (403, other 4xx) or
exhausted retries raise FetchError naming the URL.

Only calls that are safe to repeat whole are retried: reads, listings, puts of a whole object
(a second put of the same bytes leaves the same object; a put whose multipart upload the
server lost, S3's NoSuchUpload, is `LostUpload`, retried) and deletes (a second delete leaves
the object deleted; one whose first attempt went through may then see FileNotFoundError). A
stream (`RetryingReader`) retries one read at a time, from the same offset in a fresh handle.
A listing first drops what fsspec's listing cache holds for the folder, since the client is
shared by the process and the folder may have changed since (written by us or by anyone else).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from shardloader.io.retry import RetryPolicy, cause_chain, retrying
from shardloader.io.transfer import RangeRequest, read_ranges

#: Bytes per range when streaming a whole object, and ranges requested at once.
STREAM_CHUNK = 8 << 20
STREAM_PARALLEL = 4
T = TypeVar("T")


def list_directory(fs: Any, path: str, url: str, *, policy: RetryPolicy | None = None) -> list[dict[str, Any]]:
    """The entries (fsspec's `ls(detail=True)` dicts) directly in folder `path`, as listed now."""

    def listing() -> list[dict[str, Any]]:
        fs.invalidate_cache(path)
        return fs.ls(path, detail=True)

    return retrying(listing, url, policy=policy)


def object_size(fs: Any, path: str, url: str, *, policy: RetryPolicy | None = None) -> int:
    """The size in bytes of object `path`, as stored now."""

    def size() -> int:
        fs.invalidate_cache(path)
        return fs.size(path)

    return retrying(size, url, policy=policy)


def object_exists(fs: Any, path: str, url: str, *, policy: RetryPolicy | None = None) -> bool:
    """Whether `path` exists. Unlike fsspec's `exists`, which answers False for any error, a
    transient error is retried and a permanent one raised."""

    def info() -> bool:
        fs.invalidate_cache(path)
        fs.info(path)
        return True

    try:
        return retrying(info, url, policy=policy)
    except FileNotFoundError:
        return False


def read_chunks(
    fs: Any, path: str, url: str, size: int, *, policy: RetryPolicy | None = None,
    chunk_size: int = STREAM_CHUNK, parallel: int = STREAM_PARALLEL,
) -> Iterator[bytes]:
    """The `size` bytes of object `path` in order, `chunk_size` at a time, read as `parallel`
    concurrent ranges per round (`read_ranges`: a failed range is retried, the others kept)."""
    policy = policy or RetryPolicy()
    spans = [(lo, min(lo + chunk_size, size)) for lo in range(0, size, chunk_size)]
    for first in range(0, len(spans), parallel):
        requests = [RangeRequest(path, url, lo, hi, size) for lo, hi in spans[first:first + parallel]]
        chunks, _ = read_ranges(fs, requests, policy=policy)
        yield from chunks


class LostUpload(ConnectionError):
    """A whole-object put the server answered with S3's NoSuchUpload: it lost the multipart
    upload the client was making (seen when a server slow to complete one made the client send
    its completion again). Nothing is missing, and a put is safe to repeat whole, so this is
    retried as a transient error. (Any other "not found" of a put, a missing bucket or
    directory, stays a FileNotFoundError.)"""


def _error_codes(exc: BaseException) -> set[str]:
    """The S3 error codes (botocore's `response["Error"]["Code"]`) in `exc`'s cause chain."""
    codes = set()
    for current in cause_chain(exc):
        response = getattr(current, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            codes.add(str(response["Error"].get("Code")))
    return codes


def _repeatable_put(call: Callable[[], Any], url: str) -> Callable[[], None]:
    def attempt() -> None:
        try:
            call()
            return
        except FileNotFoundError as exc:
            if "NoSuchUpload" not in _error_codes(exc):
                raise
            why = f"{type(exc).__name__}: {exc}"
        # Raised outside the handler: its cause is not the 404, which would make it permanent.
        raise LostUpload(f"{url}: the server lost the upload ({why}); putting it again whole")

    return attempt


def put_file(fs: Any, local_path: str, path: str, url: str, *, policy: RetryPolicy | None = None) -> None:
    """Upload the finished local file `local_path` as object `path`, whole."""
    retrying(_repeatable_put(lambda: fs.put_file(local_path, path), url), url, policy=policy)


def put_bytes(fs: Any, data: bytes, path: str, url: str, *, policy: RetryPolicy | None = None) -> None:
    """Write `data` as object `path`, whole, with one call (`pipe_file`)."""
    retrying(_repeatable_put(lambda: fs.pipe_file(path, data), url), url, policy=policy)


def read_object(fs: Any, path: str, url: str, *, policy: RetryPolicy | None = None) -> bytes:
    """The whole content of the small object `path` (a manifest, an index)."""
    return retrying(lambda: fs.cat_file(path), url, policy=policy)


def remove_object(fs: Any, path: str, url: str, *, recursive: bool = False,
                  policy: RetryPolicy | None = None) -> None:
    """Delete object `path` (with `recursive`: everything under the folder `path`, listed
    anew on each attempt). FileNotFoundError when there is nothing to delete, which after a
    retry may mean that an attempt whose answer was lost deleted it."""
    if recursive:
        retrying(lambda: fs.rm(path, recursive=True), url, policy=policy)
    else:
        retrying(lambda: fs.rm_file(path), url, policy=policy)


class RetryingReader:
    """Object `path` read front to back through fsspec file handles (`read`, `readinto`).

    Opening is retried; a read that fails with a transient error drops its handle and is made
    again, whole, from the same offset in a fresh one, so a reset in the middle of a large
    object costs one read, not the object. The caller checks what it read (size, checksum).
    """

    def __init__(self, fs: Any, path: str, url: str, *, block_size: int = STREAM_CHUNK,
                 policy: RetryPolicy | None = None) -> None:
        self._fs, self._path, self._url = fs, path, url
        self._block_size = block_size
        self._policy = policy or RetryPolicy()
        self._file: Any = None
        self._pos = 0
        self._attempt(lambda f: None)  # opened now: a missing object fails here, not later

    def _attempt(self, op: Callable[[Any], T]) -> T:
        def call() -> T:
            try:
                if self._file is None:
                    self._file = self._fs.open(self._path, "rb", block_size=self._block_size)
                    if self._pos:
                        self._file.seek(self._pos)
                return op(self._file)
            except BaseException:
                self._drop()
                raise

        return retrying(call, self._url, policy=self._policy)

    def _drop(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except Exception:  # a handle that failed may fail to close too; it is dropped
                pass

    def read(self, size: int = -1) -> bytes:
        data = self._attempt(lambda f: f.read(size))
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._drop()

    def __enter__(self) -> RetryingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
