"""The S3 read path: GETs of whole objects and byte ranges through botocore's own S3 client.

One path for every user (I19). botocore signs each request and resolves credentials through
AWS's own chain, the one the AWS CLI and boto3 use: keys in the storage options, environment
variables, profile and config files (``profile=`` or ``AWS_PROFILE``; ``credential_process``,
``role_arn`` + ``source_profile``), web identity (EKS service accounts), container
credentials (ECS, EKS Pod Identity), instance metadata (EC2 roles), and SSO. Temporary
credentials are refreshed by botocore itself before they expire, so a long epoch keeps reading.
Endpoint, region, addressing style, proxies and CA bundles come from the same options, files
and environment as botocore's, and a bucket in another region is followed (botocore's region
redirect).

Why botocore's synchronous client and not s3fs for reads. s3fs (aiobotocore on aiohttp) costs a
fresh process 0.7-0.9 s to build its first client and 0.24-0.34 s for its first request;
botocore's own client costs 0.18-0.27 s to import, 0.10-0.13 s to build and ~12 ms for its first
request (medians of 3 fresh processes on loopback moto, 2-core machine, `benchmarks/coldstart.py`
gives the first batch per credential source). s3fs stays the client for everything else
(listing, sizes, writes: `full_interface=True` in `shardloader.io.clients`). obstore (Rust, what
litData uses) was not taken: its client used in a child forked after the parent used it hangs
(obstore 0.12.1, measured), and our workers are forked. The hand-written SigV4 signer and
connection pool this module had before were removed: they served only static keys with an
explicit endpoint (what the benchmark used), and users with roles or profiles silently got the
slow s3fs path instead.

Scope: ``cat_file``, ``cat_ranges`` and ``read_ranges_into`` (ranges streamed straight into a
file: the calls `shardloader.io.transfer` makes). `s3_reader` returns None, and s3fs is used,
only for storage options that change how bytes are fetched in ways this module does not map
(an aiobotocore ``session`` object, say), or when ``SHARDLOADER_S3_CLIENT=fsspec``.

Retries are not done here: botocore's own are off (one attempt) unless the options'
``config_kwargs`` set ``retries``. Its retry mode is "adaptive" all the same, for the rate
limiter that comes with it: once S3 answers ``SlowDown``, botocore paces the client's requests
(a token bucket per client, so per process, whose rate falls on each throttle and grows back
after), where each request's own backoff alone would let a process's many concurrent reads
keep offering more than the prefix serves. 16 nodes of 2 ranks against a prefix throttled to
20 GET/s (`benchmarks/many_nodes.py`): 1,160 SlowDowns and a peak of 114 requests/s offered
without it, 374 and 51 with it, in the same time. A failed request raises FileNotFoundError (404), PermissionError (401/403,
no credentials), `S3HTTPError` (other statuses, with ``.status``) or botocore's network error,
which `shardloader.io.transfer` classifies (`shardloader.io.retry`) and retries with its own
backoff.

Fork. A client, its connections and its threads belong to the process that made it: a forked
child gets a new client (from `shardloader.io.clients.filesystem`, keyed by pid) on a new
botocore session that reuses the parent's loaded service data (building a client then costs
~20 ms instead of ~0.1 s) and resolves its credentials itself (temporary ones from a network
source are fetched once per worker process, as every boto3 user's workers do).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shardloader.io.s3_body import DaemonThreads, copy_body_into, outcome, read_body

DISABLE_ENV = "SHARDLOADER_S3_CLIENT"
#: Bytes asked of a body per read when a range is streamed into a file. urllib3 reads each
#: into a temporary bytes of that size (then copies it into the buffer), so this bounds what
#: a range holds in memory: 4 concurrent 8 MiB ranges peaked at 3.3 MiB of Python allocations
#: with 1 MiB reads, ~1 MiB with these.
READ_SIZE = 256 << 10
#: s3fs options that only steer its caches, listings or uploads: nothing about how a GET is made.
_READ_IRRELEVANT = frozenset({
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
    "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions",
    "max_concurrency", "fixed_upload_size", "asynchronous", "loop", "version_aware",
})
#: s3fs options mapped onto botocore's client or request.
_MAPPED = frozenset({"key", "secret", "token", "anon", "profile", "endpoint_url", "use_ssl",
                     "client_kwargs", "config_kwargs", "requester_pays", "s3_additional_kwargs"})


class S3HTTPError(OSError):
    """An S3 answer other than 200/206 and other than 401/403/404 (`status`, URL, S3's `code`,
    such as ``SlowDown``, or "")."""

    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class S3Options:
    """How to reach the bucket, as botocore takes it: the profile (None: the default chain),
    keyword arguments of `create_client` (endpoint, region, keys, verify, ...), of
    `botocore.config.Config`, and extra GET parameters (RequestPayer, SSE-C keys)."""

    profile: str | None
    client: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    request: dict[str, Any] = field(default_factory=dict)
    anon: bool = False


def s3_options(storage_options: dict[str, Any], environ: Any = os.environ) -> S3Options | None:
    """`storage_options` (s3fs's names) as botocore's arguments, or None when s3fs must serve
    them (see the module docstring). Pure apart from reading `environ`."""
    if environ.get(DISABLE_ENV, "").lower() in ("fsspec", "s3fs", "off", "0"):
        return None
    options = dict(storage_options)
    if set(options) - _MAPPED - _READ_IRRELEVANT:
        return None
    client = dict(options.get("client_kwargs") or {})
    for ours, botos in (("key", "aws_access_key_id"), ("secret", "aws_secret_access_key"),
                        ("token", "aws_session_token"), ("endpoint_url", "endpoint_url"),
                        ("use_ssl", "use_ssl")):
        if options.get(ours) is not None:
            client.setdefault(botos, options[ours])
    config = dict(options.get("config_kwargs") or {})
    # One attempt: shardloader.io.transfer retries. Adaptive mode: after an answer asking to slow
    # down, botocore's client-side rate limiter paces this process's requests (see the docstring).
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "adaptive"})
    request = dict(options.get("s3_additional_kwargs") or {})
    if options.get("requester_pays"):
        request.setdefault("RequestPayer", "requester")
    return S3Options(profile=options.get("profile"), client=client, config=config,
                     request=request, anon=bool(options.get("anon", False)))


# -- sessions: one per process and profile -----------------------------------------------------
_SESSIONS: dict[tuple[int, str | None], Any] = {}
_SESSIONS_LOCK = threading.Lock()


def botocore_session(profile: str | None, *, own_credentials: bool = False) -> Any:
    """This process's botocore session for `profile`. A forked child reuses its parent's
    session (Session() costs ~50 ms in a worker) unless that session holds refreshable
    credentials, whose refresh lock a thread of the parent may have held at the fork: then it
    gets a new session sharing the parent's loaded service data (read-only JSON) and resolving
    its own credentials. `own_credentials`: the client brings its keys, so the session's never
    matter."""
    with _SESSIONS_LOCK:
        session = _SESSIONS.get((os.getpid(), profile))
        if session is None:
            parent = next((s for (_, p), s in _SESSIONS.items() if p == profile), None)
            if parent is not None and (own_credentials or not _refreshable(parent)):
                session = parent
            else:
                import botocore.session

                session = botocore.session.Session(profile=profile)
                if parent is not None:
                    session.register_component("data_loader", parent.get_component("data_loader"))
            _SESSIONS[(os.getpid(), profile)] = session
    return session


def _refreshable(session: Any) -> bool:
    """Whether `session`'s credentials (resolved, in the parent, by its first client) refresh."""
    return hasattr(session.get_credentials(), "refresh_needed")


def _after_fork_in_child() -> None:
    global _SESSIONS_LOCK
    _SESSIONS_LOCK = threading.Lock()  # it may have been held by a thread the child lacks


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the client --------------------------------------------------------------------------------
class S3Reader:
    """GETs of objects given as ``bucket/key`` paths (fsspec's convention for s3 URLs), with the
    part of fsspec's filesystem interface that `shardloader.io.transfer` uses."""

    protocol = "s3"

    def __init__(self, options: S3Options) -> None:
        self.options = options
        self._pid = os.getpid()
        self._client: Any = None
        self._lock = threading.Lock()
        self._threads = DaemonThreads(int(options.config.get("max_pool_connections", 10)),
                                      "shardloader-s3")

    @property
    def client(self) -> Any:
        """botocore's S3 client, built on first use (in this process only)."""
        if self._pid != os.getpid():  # never a parent's connections or threads in a child
            raise RuntimeError("S3Reader used in a forked child; make one per process")
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._build()
        return self._client

    def _build(self) -> Any:
        from botocore import UNSIGNED
        from botocore.config import Config

        config = dict(self.options.config)
        if self.options.anon:
            config["signature_version"] = UNSIGNED
        own = self.options.anon or "aws_access_key_id" in self.options.client
        session = botocore_session(self.options.profile, own_credentials=own)
        return session.create_client("s3", config=Config(**config), **self.options.client)

    # fsspec's interface (the parts used) ------------------------------------------------------
    @staticmethod
    def _strip_protocol(url: str) -> str:
        for prefix in ("s3://", "s3a://"):
            if url.startswith(prefix):
                url = url[len(prefix):]
        return url.rstrip("/")

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes (or [start, end)); raises as the module docstring says."""
        path = self._strip_protocol(path)
        if start is not None and end is not None and end <= start:
            return b""
        byte_range = None
        if start is not None or end is not None:
            byte_range = f"bytes={start or 0}-" + ("" if end is None else str(end - 1))
        return self._get(path, byte_range, read_body)

    def cat_ranges(self, paths: Sequence[str], starts: Sequence[int], ends: Sequence[int],
                   on_error: str = "return", **_: Any) -> list[Any]:
        """Bytes [start, end) of each path, requested concurrently; with `on_error="return"`
        a failed range's exception takes its place in the list."""
        if not (len(paths) == len(starts) == len(ends)):
            raise ValueError("cat_ranges: paths, starts and ends differ in length")
        calls = [lambda p=p, s=s, e=e: self.cat_file(p, s, e) for p, s, e in zip(paths, starts, ends)]
        results = self._run_all(calls)
        if on_error != "return":
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return results

    def read_ranges_into(self, path: str, ranges: Sequence[tuple[int, int]], fd: int,
                         buffer_size: int = READ_SIZE) -> list[int | BaseException]:
        """Bytes [start, end) of object `path` for each range, written at offset `start` of
        file `fd`, the ranges requested concurrently; in place of each range, the bytes written
        (always end - start) or the exception it failed with. See `read_range_into`."""
        return self._run_all([lambda lo=lo, hi=hi: self.read_range_into(path, lo, hi, fd, lo, buffer_size)
                              for lo, hi in ranges])

    def read_range_into(self, path: str, start: int, end: int, fd: int, file_offset: int,
                        buffer_size: int = READ_SIZE) -> int:
        """Copy bytes [start, end) of object `path` into file `fd` from `file_offset` on, as the
        response arrives, `buffer_size` bytes at a time (`READ_SIZE`); returns the bytes written (end - start).

        Why streamed: read whole, a download's 8 MiB ranges were as many 8 MiB bodies in the
        training process at once, and their churn left glibc's per-thread arenas holding
        ~100 MiB more after a remote epoch. A body that ends early is a ShortRead; an error
        writing `fd` is raised unchanged. After an error the file's bytes in the range are
        undefined."""
        if end <= start:
            return 0
        return self._get(self._strip_protocol(path), f"bytes={start}-{end - 1}",
                         lambda answer: copy_body_into(answer, fd, start, end, file_offset, buffer_size))

    # requests ---------------------------------------------------------------------------------
    def _get(self, path: str, byte_range: str | None, read: Any) -> Any:
        """`read(answer)` of a GET of ``bucket/key`` `path` (botocore's answer dict)."""
        bucket, _, key = path.partition("/")
        if not bucket or not key:
            raise FileNotFoundError(f"s3://{path}: not an object path (bucket/key)")
        params = {"Bucket": bucket, "Key": key, **self.options.request}
        if byte_range is not None:
            params["Range"] = byte_range
        from botocore.exceptions import ClientError, NoCredentialsError

        try:
            answer = self.client.get_object(**params)
        except ClientError as e:
            raise _error_for(path, e) from e
        except NoCredentialsError as e:
            raise PermissionError(
                f"s3://{path}: no AWS credentials found (looked in the storage options, the "
                "environment, profile and config files, web identity, container credentials, "
                "instance metadata and SSO); give some, or anon=True for a public bucket") from e
        try:
            return read(answer)
        finally:
            answer["Body"].close()

    def _run_all(self, calls: list[Any]) -> list[Any]:
        """Each call's result or exception, the calls run concurrently on this client's threads."""
        if len(calls) == 1:
            return [outcome(calls[0])]
        futures = [self._threads.submit(call) for call in calls]
        return [outcome(f.result) for f in futures]

    def __repr__(self) -> str:
        return (f"S3Reader(profile={self.options.profile!r}, "
                f"endpoint={self.options.client.get('endpoint_url')!r})")


def _error_for(path: str, error: Any) -> OSError:
    """The exception for botocore's ClientError `error` on a GET of `path`."""
    response = getattr(error, "response", {}) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    code = response.get("Error", {}).get("Code", "")
    message = f"s3://{path}: HTTP {status}" + (f" ({code})" if code else "")
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket"):
        return FileNotFoundError(message)
    if status in (401, 403):
        refused = PermissionError(message)
        refused.status = status  # type: ignore[attr-defined]
        return refused
    return S3HTTPError(int(status), message, code)


def s3_reader(url: str, storage_options: dict[str, Any]) -> S3Reader | None:
    """This module's client for `url` (s3:// or s3a://) and `storage_options`, or None when
    s3fs must be used (see the module docstring)."""
    if not url.startswith(("s3://", "s3a://")):
        return None
    options = s3_options(storage_options)
    return S3Reader(options) if options is not None else None
