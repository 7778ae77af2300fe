"""What is transient, how long to wait before trying again, and a retry loop for single calls.

Only this module decides what is transient: timeouts, connection resets, 5xx, 429, a short or
empty body. The rules look through an exception's cause chain for an HTTP status (aiohttp's
`ClientResponseError.status`, botocore's `ClientError` response, which s3fs keeps as
`__cause__` of the `OSError` it raises) before falling back to the type. Permanent errors
(404, 403, other 4xx) are never retried, nor a file system's refusal (`is_refusal`: disk full,
quota exceeded, read-only), which no wait fixes.

The backoff is exponential with jitter and bounded twice, in attempts and in total seconds
(`RetryPolicy`). `shardloader.io.transfer` applies it to byte ranges (keeping what already
arrived); `retrying` applies it to one call made as a whole (a listing, a size, a put).
"""

from __future__ import annotations

import errno
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from shardloader.errors import FetchError

TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
)
#: What an OSError without an HTTP status says when the file system refuses the operation
#: itself (disk full, quota exceeded, read-only, file too large).
REFUSED_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EFBIG") if hasattr(errno, name)
)
T = TypeVar("T")


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


def is_refusal(exc: BaseException | None) -> bool:
    """True when `exc` is a file system's refusal (REFUSED_ERRNOS), not a network's failure."""
    return isinstance(exc, OSError) and exc.errno in REFUSED_ERRNOS and http_status(exc) is None


def is_transient(exc: BaseException) -> bool:
    """True when retrying `exc` may succeed (timeouts, resets, 5xx, 429, short bodies)."""
    if isinstance(exc, FetchCancelled):
        return False
    status = http_status(exc)
    if status is not None:
        return status in TRANSIENT_STATUS
    if isinstance(exc, _PERMANENT_TYPES) or is_refusal(exc):
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


def permanent_reason(error: BaseException) -> str:
    """Why a permanent error is one, for a message that names the URL before it."""
    status = http_status(error)
    if isinstance(error, FileNotFoundError) or status == 404:
        return f"not found ({describe(error)})"
    if isinstance(error, PermissionError) or status in (401, 403):
        return f"access denied ({describe(error)})"
    return f"permanent error: {describe(error)}"


def pause(delay: float, url: str, cancel: threading.Event | None) -> None:
    """Wait `delay` seconds before a retry; FetchCancelled as soon as `cancel` is set."""
    if cancel is not None:
        if cancel.wait(delay):
            raise FetchCancelled(url)
    elif delay > 0:
        time.sleep(delay)


def retrying(
    call: Callable[[], T],
    url: str,
    *,
    policy: RetryPolicy | None = None,
    rng: random.Random | None = None,
    passthrough: tuple[type[BaseException], ...] = (FileNotFoundError,),
) -> T:
    """What `call()` returns, calling it again after transient errors with `policy`'s backoff.

    Only for calls that are safe to repeat whole (reads, listings, whole-object puts). Errors
    of the `passthrough` types are raised unchanged (callers give a missing object their own
    message); other permanent errors and exhausted retries raise FetchError naming `url`.
    """
    policy = policy or RetryPolicy()
    rng = rng or random.Random()
    start = time.monotonic()
    for attempt in range(policy.attempts):
        try:
            return call()
        except passthrough:
            raise
        except Exception as e:
            if not is_transient(e):
                raise FetchError(f"{url}: {permanent_reason(e)}") from e
            delay = policy.backoff(attempt, rng)
            if attempt + 1 >= policy.attempts or time.monotonic() + delay - start > policy.deadline:
                raise FetchError(
                    f"{url}: giving up after {attempt + 1} failed attempts; last error: {describe(e)}"
                ) from e
            pause(delay, url, None)
    raise AssertionError("unreachable")
