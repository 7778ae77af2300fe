"""The one place a URL becomes a filesystem client: `filesystem(url, storage_options)`.

Every module that opens a URL (the shard cache, reads by range, `index.json`, `verify`,
`index`, output directories, checkpoint storage) gets its client here, so all of them share
what is decided once:

- One client per process and set of options, kept for the life of the process (see "Fork"
  below): connections are reused across calls and modules.
- S3 clients get a connection pool sized for concurrent range reads (`S3_POOL_CONNECTIONS`).
- Reads of s3:// URLs go through botocore's own client (`shardloader.io.s3client`: no s3fs,
  aiobotocore or aiohttp import; every credential source of AWS's chain; see there why);
  callers that need more of fsspec's interface than `cat_file`/`cat_ranges` (listing, sizes,
  `open`, writes) ask for `full_interface=True` and always get fsspec's filesystem.
- A forked child builds clients of its own, reusing its parent's botocore session.

Retries are not done here: `shardloader.io.retry` decides what is transient, and
`shardloader.io.transfer`/`shardloader.io.objects` retry the calls made on these clients.

A client is shared by everyone in the process who asks with the same options, so callers never
close it, and callers that list after writing (checkpoint storage, output directories) drop
fsspec's listing cache for the path first (`invalidate_cache`) rather than trust it.

Fork. fsspec's async clients (s3fs, http) close their sessions from a finalizer on the event
loop of the process that created them. A client that becomes garbage in a forked worker (fsspec
clears its instance cache there; a client with reference cycles may still await collection at
the fork) is finalized against the parent's loop, and aiobotocore prints "attached to a
different loop" errors. So clients are kept here for the life of the process, and a child keeps
every client it inherited (ours and fsspec's cached ones) alive and unused.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from typing import Any

_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_INHERITED: list[Any] = []

#: Connections per S3 client when the options do not say. botocore's default pool of 10 makes
#: the concurrent byte-range reads of one batch (tens of requests, each mostly latency) queue
#: in waves of 10: measured 0.4 s instead of 0.05 s for a batch from 16 cold shards on loopback
#: S3 with 30 ms per request.
S3_POOL_CONNECTIONS = 64


def _options_key(options: dict[str, Any]) -> bytes | str:
    try:
        return pickle.dumps(sorted(options.items()))
    except Exception:  # unpicklable option values: their repr still tells configurations apart
        return repr(sorted(options.items(), key=lambda kv: kv[0]))


def filesystem(
    url: str, storage_options: dict[str, Any] | None = None, *, full_interface: bool = False,
) -> tuple[Any, str]:
    """(filesystem, path) for `url`: this process's client for these options.

    For s3:// URLs, unless `full_interface`, the read-only botocore client of
    `shardloader.io.s3client` (`cat_file` and `cat_ranges` only); else fsspec's filesystem for
    the protocol, with its whole interface."""
    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        options = _with_connection_pool(options)
    if "::" in url:  # chained URLs: let fsspec build the chain each time
        import fsspec

        return fsspec.core.url_to_fs(url, **options)
    # The protocol as fsspec's split_protocol reads it ("file" for a plain path), without
    # importing fsspec: the botocore S3 reader below needs none of it.
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    kind = "fsspec" if full_interface else "read"
    key = (os.getpid(), protocol, _options_key(options), kind)
    with _CLIENTS_LOCK:
        fs = _CLIENTS.get(key)
        if fs is None and protocol in ("s3", "s3a") and not full_interface:
            from shardloader.io.s3client import s3_reader

            fs = s3_reader(url, options)
            if fs is not None:
                _CLIENTS[key] = fs
        if fs is None:
            import fsspec

            extra: dict[str, Any] = {"skip_instance_cache": True}
            session = _INHERITED_SESSIONS.get(key[1:3])
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


def _with_connection_pool(options: dict[str, Any]) -> dict[str, Any]:
    config = dict(options.get("config_kwargs") or {})
    if "max_pool_connections" in config:
        return options
    config["max_pool_connections"] = S3_POOL_CONNECTIONS
    return {**options, "config_kwargs": config}


def _keep_inherited_clients() -> None:
    global _CLIENTS_LOCK
    _CLIENTS_LOCK = threading.Lock()
    for (_pid, protocol, options, _kind), fs in _CLIENTS.items():
        session = _reusable_session(fs)
        if session is not None:
            _INHERITED_SESSIONS[(protocol, options)] = session
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
