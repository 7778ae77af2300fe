"""Downloading one remote object into a local file, with retries that are bounded in total.

The object is read as byte ranges (`chunk_size` each, `parallel` at a time through fsspec's
`cat_ranges`, which runs them concurrently on async filesystems such as s3fs and http). Ranges
that fail with a transient error (timeout, connection reset, 5xx, 429, a short or empty body) are
fetched again after an exponential backoff with jitter; ranges already written are kept, so a
reset near the end of a large shard does not restart it. When every range is in, the file is
hashed and compared with the index checksum; a mismatch downloads the whole object again, up to
`checksum_attempts` times. Permanent errors (404, 403, other 4xx, checksum mismatch after the
retries, retries or deadline exhausted) raise `FetchError` naming the URL and the cause.

Only this module decides what is transient. The rules look through an exception's cause chain
for an HTTP status (aiohttp's `ClientResponseError.status`, botocore's `ClientError` response,
which s3fs keeps as `__cause__` of the `OSError` it raises) before falling back to the type.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardloader.errors import FetchError
from shardloader.format.checksum import checksum_fd, parse_checksum

TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
)


# -- filesystem clients: one per process and set of options, never dropped ---------------------
#
# fsspec's async clients (s3fs, http) close their sessions from a finalizer on the event loop
# of the process that created them. A client that becomes garbage in a forked worker (fsspec
# clears its instance cache there; a client with reference cycles may still await collection at
# the fork) is finalized against the parent's loop, and aiobotocore prints "attached to a
# different loop" errors. So clients are kept here for the life of the process, and a child keeps
# every client it inherited (ours and fsspec's cached ones) alive and unused.

_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_INHERITED: list[Any] = []


def _options_key(options: dict[str, Any]) -> bytes | str:
    try:
        return pickle.dumps(sorted(options.items()))
    except Exception:  # unpicklable option values: their repr still tells configurations apart
        return repr(sorted(options.items(), key=lambda kv: kv[0]))


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(filesystem, path) for reading `url`: this process's client for these options. For
    s3:// URLs whose options it handles, the standard-library client of
    `shardloader.cache.s3get` (no s3fs import, no botocore session; see there why); else
    fsspec's filesystem for the protocol."""
    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        options = _with_connection_pool(options)
    if "::" in url:  # chained URLs: let fsspec build the chain each time
        import fsspec

        return fsspec.core.url_to_fs(url, **options)
    # The protocol as fsspec's split_protocol reads it ("file" for a plain path), without
    # importing fsspec: the standard-library S3 client below needs none of it.
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    key = (os.getpid(), protocol, _options_key(options))
    with _CLIENTS_LOCK:
        fs = _CLIENTS.get(key)
        if fs is None and protocol in ("s3", "s3a"):
            from shardloader.cache.s3get import s3_reader

            fs = s3_reader(url, options)
            if fs is not None:
                _CLIENTS[key] = fs
        if fs is None:
            import fsspec

            extra: dict[str, Any] = {"skip_instance_cache": True}
            session = _INHERITED_SESSIONS.get(key[1:])
            if session is not None and "session" not in options:
                extra["session"] = session
            fs, path = fsspec.core.url_to_fs(url, **{**options, **extra})
            _CLIENTS[key] = fs
            return fs, path
    return fs, fs._strip_protocol(url)


# s3fs builds an aiobotocore session per client, and building one in a fresh process (loading
# botocore's service data) costs ~0.15 s of CPU: most of a worker's first request to S3 (0.25 s
# vs 0.09 s measured on loopback). A forked child reuses the session of the client the parent
# built for the same options: a session holds configuration, loaded service models and static
# credentials, no connection and no event loop. Sessions with refreshable credentials (their
# refresh lock may be bound to the parent's loop) are not reused.
_INHERITED_SESSIONS: dict[tuple[Any, ...], Any] = {}


def _reusable_session(fs: Any) -> Any:
    session = getattr(fs, "session", None)
    if session is None or type(session).__name__ != "AioSession":
        return None
    credentials = getattr(session, "_credentials", None)
    if credentials is not None and hasattr(credentials, "refresh_needed"):
        return None
    return session


#: Connections per S3 client when the options do not say. botocore's default pool of 10 makes
#: the concurrent byte-range reads of one batch (tens of requests, each mostly latency) queue
#: in waves of 10: measured 0.4 s instead of 0.05 s for a batch from 16 cold shards on loopback
#: S3 with 30 ms per request.
S3_POOL_CONNECTIONS = 64


def _with_connection_pool(options: dict[str, Any]) -> dict[str, Any]:
    config = dict(options.get("config_kwargs") or {})
    if "max_pool_connections" in config:
        return options
    config["max_pool_connections"] = S3_POOL_CONNECTIONS
    return {**options, "config_kwargs": config}


def _keep_inherited_clients() -> None:
    global _CLIENTS_LOCK
    _CLIENTS_LOCK = threading.Lock()
    for (_pid, *rest), fs in _CLIENTS.items():
        session = _reusable_session(fs)
        if session is not None:
            _INHERITED_SESSIONS[tuple(rest)] = session
    _INHERITED.extend(_CLIENTS.values())
    spec = sys.modules.get("fsspec.spec")
    if spec is None:  # the parent never loaded fsspec: no instance of it to keep (nor import)
        return
    pending = [spec.AbstractFileSystem]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        cache = cls.__dict__.get("_cache")
        if isinstance(cache, dict):
            _INHERITED.extend(cache.values())


os.register_at_fork(after_in_child=_keep_inherited_clients)


class FetchCancelled(Exception):
    """The download was stopped on request (prefetcher shutdown); nothing was committed."""


class ShortRead(OSError):
    """A range came back with fewer (or other) bytes than requested."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before giving up on one object.

    `attempts` bounds the rounds that end with at least one failed range (a round that makes no
    progress and one that makes some both count); `deadline` bounds the seconds spent on one
    object in total, backoff included; `checksum_attempts` bounds whole downloads whose bytes
    do not match the index. The backoff before retry k (0-based) is drawn uniformly from
    [d/2, d] with d = min(max_delay, base_delay * 2**k): exponential, with jitter so that many
    processes that failed together do not retry together.
    """

    attempts: int = 10
    base_delay: float = 0.2
    max_delay: float = 10.0
    deadline: float = 600.0
    checksum_attempts: int = 3

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.checksum_attempts < 1:
            raise ValueError("RetryPolicy: attempts and checksum_attempts must be at least 1")
        if self.base_delay < 0 or self.max_delay < 0 or self.deadline <= 0:
            raise ValueError("RetryPolicy: delays must be >= 0 and the deadline > 0")

    def backoff(self, retry: int, rng: random.Random) -> float:
        ceiling = min(self.max_delay, self.base_delay * (2.0 ** min(retry, 60)))
        return rng.uniform(ceiling / 2, ceiling)


@dataclass
class FetchStats:
    """What one download cost: bytes received (retried ranges included), seconds, retries."""

    bytes_received: int = 0
    seconds: float = 0.0
    retries: int = 0
    checksum_failures: int = 0


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind `exc`, looking through its cause chain; None when there is none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        status = getattr(current, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        current = current.__cause__ or current.__context__
    return None


def is_transient(exc: BaseException) -> bool:
    """True when retrying `exc` may succeed (timeouts, resets, 5xx, 429, short bodies)."""
    if isinstance(exc, FetchCancelled):
        return False
    status = http_status(exc)
    if status is not None:
        return status in TRANSIENT_STATUS
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    return _is_network_library_error(exc)


def _is_network_library_error(exc: BaseException) -> bool:
    """aiohttp client errors and botocore's connection/read errors, without hard imports."""
    try:
        import aiohttp

        if isinstance(exc, aiohttp.ClientError):
            return True
    except ImportError:  # pragma: no cover - aiohttp is a dependency
        pass
    try:
        from botocore import exceptions as bexc

        network = (
            bexc.ConnectionError, bexc.HTTPClientError, bexc.IncompleteReadError,
            bexc.ResponseStreamingError,
        )
        if isinstance(exc, network):
            return True
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    import asyncio

    return isinstance(exc, asyncio.TimeoutError) or type(exc).__name__ == "FSTimeoutError"


def describe(exc: BaseException) -> str:
    status = http_status(exc)
    text = f"{type(exc).__name__}: {exc}".strip()
    return f"HTTP {status} ({text})" if status is not None else text


def download(
    fs: Any,
    path: str,
    url: str,
    fd: int,
    *,
    size: int,
    checksum: str,
    policy: RetryPolicy,
    chunk_size: int = 8 << 20,
    parallel: int = 4,
    cancel: threading.Event | None = None,
    rng: random.Random | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> FetchStats:
    """Write remote object `path` (on fsspec filesystem `fs`; `url` names it in errors) into
    the open, empty file `fd`, and check it has `size` bytes hashing to `checksum`.

    Returns the costs. Raises FetchError when the object cannot be fetched whole and correct,
    FetchCancelled when `cancel` is set. The file's content is undefined after an error.
    """
    algorithm, _ = parse_checksum(checksum)
    rng = rng or random.Random()
    stats = FetchStats()
    start = time.monotonic()
    deadline = start + policy.deadline
    failures = 0

    def wait_before_retry(exc: BaseException) -> None:
        nonlocal failures
        failures += 1
        stats.retries += 1
        if failures >= policy.attempts:
            raise FetchError(
                f"{url}: giving up after {failures} failed attempts; last error: {describe(exc)}"
            ) from exc
        delay = policy.backoff(failures - 1, rng)
        if time.monotonic() + delay > deadline:
            raise FetchError(
                f"{url}: giving up after {time.monotonic() - start:.1f} s (deadline "
                f"{policy.deadline:g} s, {failures} failed attempts); last error: {describe(exc)}"
            ) from exc
        if on_retry is not None:
            on_retry(exc, delay)
        if cancel is not None:
            if cancel.wait(delay):
                raise FetchCancelled(url)
        elif delay > 0:
            time.sleep(delay)

    for whole in range(policy.checksum_attempts):
        os.ftruncate(fd, 0)
        pending = [(lo, min(lo + chunk_size, size)) for lo in range(0, size, chunk_size)]
        while pending:
            if cancel is not None and cancel.is_set():
                raise FetchCancelled(url)
            batch, pending = pending[:parallel], pending[parallel:]
            results = _cat_ranges(fs, path, batch)
            failed: list[tuple[int, int]] = []
            first_error: BaseException | None = None
            for (lo, hi), result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    error: BaseException | None = result
                else:
                    data, error = _check_range(result, lo, hi, size)
                    if error is None:
                        os.pwrite(fd, data, lo)
                        stats.bytes_received += len(data)
                if error is not None:
                    if not is_transient(error):
                        raise FetchError(f"{url}: {_permanent_reason(error, lo, hi, size)}") from error
                    failed.append((lo, hi))
                    first_error = first_error or error
            if failed:
                pending = failed + pending
                assert first_error is not None
                wait_before_retry(first_error)
        actual, _ = checksum_fd(fd, algorithm)
        if actual == checksum:
            stats.seconds = time.monotonic() - start
            return stats
        stats.checksum_failures += 1
        if whole + 1 < policy.checksum_attempts:
            wait_before_retry(
                ShortRead(f"downloaded bytes hash to {actual}, the index records {checksum}")
            )
    raise FetchError(
        f"{url}: checksum mismatch after {policy.checksum_attempts} downloads: the remote object "
        f"hashes to {actual} but the index records {checksum} (the object or the index is wrong)"
    )


def _cat_ranges(fs: Any, path: str | list[str], ranges: list[tuple[int, int]]) -> list[Any]:
    paths = path if isinstance(path, list) else [path] * len(ranges)
    try:
        results = fs.cat_ranges(
            paths, [lo for lo, _ in ranges], [hi for _, hi in ranges],
            on_error="return",
        )
    except Exception as e:  # a failure of the whole call counts against every range
        return [e] * len(ranges)
    if len(results) != len(ranges):
        return [ShortRead(f"asked for {len(ranges)} ranges, got {len(results)} results")] * len(ranges)
    return list(results)


def _check_range(data: Any, lo: int, hi: int, size: int) -> tuple[bytes, BaseException | None]:
    """The bytes of range [lo, hi) in `data`, or the error to record for it."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return b"", TypeError(f"filesystem returned {type(data).__name__} for a byte range")
    want = hi - lo
    if len(data) == want:
        return bytes(data), None
    if len(data) == size and size > want:  # the server ignored the Range header
        return bytes(data[lo:hi]), None
    return b"", ShortRead(f"range {lo}-{hi - 1} returned {len(data)} bytes instead of {want}")


def _permanent_reason(error: BaseException, lo: int, hi: int, size: int) -> str:
    status = http_status(error)
    if isinstance(error, FileNotFoundError) or status == 404:
        return f"not found ({describe(error)})"
    if isinstance(error, PermissionError) or status in (401, 403):
        return f"access denied ({describe(error)})"
    if status == 416:
        return (
            f"range {lo}-{hi - 1} is outside the remote object, which is shorter than the "
            f"{size} bytes the index records ({describe(error)})"
        )
    return f"permanent error: {describe(error)}"


@dataclass(frozen=True)
class RangeRequest:
    """Bytes [lo, hi) of remote object `path` (`url` names it in errors; `size` is the object's
    size by the index, to recognise a server that ignored the Range header)."""

    path: str
    url: str
    lo: int
    hi: int
    size: int


def read_ranges(
    fs: Any,
    requests: list[RangeRequest],
    *,
    policy: RetryPolicy,
    rng: random.Random | None = None,
    cancel: threading.Event | None = None,
) -> tuple[list[bytes], FetchStats]:
    """The bytes of every request (any objects), fetched concurrently in one `cat_ranges` call
    per round, with the same transient-error rules, backoff and bounds as `download`.

    Raises FetchError naming the URL on a permanent error or when retries run out. The caller
    verifies what came back (ranges carry no checksum of their own here)."""
    rng = rng or random.Random()
    stats = FetchStats()
    start = time.monotonic()
    out: list[bytes | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    failures = 0
    while pending:
        if cancel is not None and cancel.is_set():
            raise FetchCancelled(requests[pending[0]].url)
        results = _cat_ranges(fs, [requests[i].path for i in pending],
                              [(requests[i].lo, requests[i].hi) for i in pending])
        failed: list[int] = []
        first_error: BaseException | None = None
        for i, result in zip(pending, results, strict=True):
            r = requests[i]
            if isinstance(result, BaseException):
                error: BaseException | None = result
            else:
                data, error = _check_range(result, r.lo, r.hi, r.size)
                if error is None:
                    out[i] = data
                    stats.bytes_received += len(data)
            if error is not None:
                if not is_transient(error):
                    raise FetchError(f"{r.url}: {_permanent_reason(error, r.lo, r.hi, r.size)}") from error
                failed.append(i)
                first_error = first_error or error
        pending = failed
        if pending:
            assert first_error is not None
            failures += 1
            stats.retries += 1
            url = requests[pending[0]].url
            delay = policy.backoff(failures - 1, rng)
            if failures >= policy.attempts or time.monotonic() + delay - start > policy.deadline:
                raise FetchError(
                    f"{url}: giving up on a byte-range read after {failures} failed attempts; "
                    f"last error: {describe(first_error)}"
                ) from first_error
            if cancel is not None:
                if cancel.wait(delay):
                    raise FetchCancelled(url)
            elif delay > 0:
                time.sleep(delay)
    stats.seconds = time.monotonic() - start
    return [b for b in out if b is not None], stats


def read_bytes(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    policy: RetryPolicy | None = None,
    rng: random.Random | None = None,
) -> bytes:
    """The whole content of a small remote object (e.g. `index.json`), with the same retries.

    FileNotFoundError passes through unchanged (callers give it their own message); other
    permanent errors and exhausted retries raise FetchError.
    """
    policy = policy or RetryPolicy()
    rng = rng or random.Random()
    fs, path = filesystem(url, storage_options)
    start = time.monotonic()
    for attempt in range(policy.attempts):
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            raise
        except Exception as e:
            if not is_transient(e):
                raise FetchError(f"{url}: {_permanent_reason(e, 0, 0, 0)}") from e
            delay = policy.backoff(attempt, rng)
            if attempt + 1 >= policy.attempts or time.monotonic() + delay - start > policy.deadline:
                raise FetchError(
                    f"{url}: giving up after {attempt + 1} failed attempts; last error: {describe(e)}"
                ) from e
            time.sleep(delay)
    raise AssertionError("unreachable")
