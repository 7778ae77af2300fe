"""The filesystem under the node cache: its free space, whether it can be written, and the error
that says so when it cannot.

A cache directory on a read-only filesystem, one this user may not write, or a filesystem that
fills up surface deep inside a worker as the operating system's or sqlite's own words ("unable
to open database file", "database or disk is full", "Read-only file system"). Every write the
cache makes goes through `disk_errors`, which turns those into one `CacheDiskError` naming the
cache directory, what was being written, and the filesystem's state now (read-only, or its free
space out of its size).

Planning (`room.make_room`) never reserves beyond the free space either: a download is planned
only when it fits in what the filesystem has free, less the downloads in flight still to be
written and `DISK_MARGIN`, evicting least recently used shards to make it fit; so a default
`cache_limit` (a share of the space free when the cache was opened) on a small or shared
filesystem evicts instead of filling the disk when others take space meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator

from shardloader.cache.layout import temp_owner
from shardloader.errors import CacheDiskError
from shardloader.units import format_size

#: Bytes of the cache's filesystem that planning leaves free beyond shards and downloads in
#: flight, for what grows between two plannings: the ledger (its sqlite file and write-ahead
#: log, up to `ledger.LEDGER_WAL_BYTES`; what they hold already is in the free space measured),
#: lock files, directory blocks.
DISK_MARGIN = 2 << 20

_FULL_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, n))
_DENIED_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_SQLITE_FULL = ("SQLITE_FULL",)
_SQLITE_DENIED = ("SQLITE_CANTOPEN", "SQLITE_READONLY", "SQLITE_PERM")
_SQLITE_FULL_WORDS = ("database or disk is full",)
_SQLITE_DENIED_WORDS = ("unable to open database file", "readonly database")
ADVICE_FULL = ("free space there, lower cache_limit, or point cache_dir (or "
               "$SHARDLOADER_CACHE_DIR) at a filesystem with room")
ADVICE_DENIED = "point cache_dir (or $SHARDLOADER_CACHE_DIR) at a local directory this user can write"
ADVICE_IO = ("check that disk (the kernel log says more), or point cache_dir (or "
             "$SHARDLOADER_CACHE_DIR) at another one")


def free_space(path: str) -> tuple[int, int] | None:
    """(bytes free to this user, bytes in all) on the filesystem of `path`; None if unknown
    (no statvfs, or a filesystem that reports no size at all, as some FUSE mounts do)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def read_only(path: str) -> bool:
    """True when the filesystem of `path` is mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def space_words(path: str) -> str:
    """'its filesystem has 1.9 MiB free of 8.0 MiB' (or that its free space is unknown)."""
    space = free_space(path)
    if space is None:
        return "its filesystem's free space is unknown"
    free, total = space
    return f"its filesystem has {format_size(free)} free of {format_size(total)}"


def _kind(exc: BaseException, root: str) -> str | None:
    """'full', 'denied', 'io' or None (not a refusal of the cache's filesystem)."""
    sqlite3 = sys.modules.get("sqlite3")  # imported by the ledger: no sqlite error without it
    if sqlite3 is not None and isinstance(exc, sqlite3.OperationalError):
        name = getattr(exc, "sqlite_errorname", "") or ""  # Python 3.11+
        text = str(exc).lower()
        if name.startswith(_SQLITE_FULL) or any(w in text for w in _SQLITE_FULL_WORDS):
            return "full"
        if name.startswith(_SQLITE_DENIED) or any(w in text for w in _SQLITE_DENIED_WORDS):
            return "denied"
        if name.startswith("SQLITE_IOERR") or "disk i/o error" in text:
            return "io"
        return None
    if not isinstance(exc, OSError):
        return None
    if exc.errno in _FULL_ERRNOS:
        return "full"
    if exc.errno == errno.EROFS:
        return "denied"
    if exc.errno == errno.EIO:
        return "io"
    if exc.errno in _DENIED_ERRNOS:  # permission: only for paths of the cache (or none named)
        name = exc.filename if isinstance(exc.filename, str) else None
        if name is None or _related(os.path.abspath(name), os.path.abspath(root)):
            return "denied"
    return None


def _related(path: str, root: str) -> bool:
    """True when `path` is `root`, inside it, or one of its parents (creating it failed)."""
    inside = path == root or path.startswith(root.rstrip(os.sep) + os.sep)
    return inside or root.startswith(path.rstrip(os.sep) + os.sep)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        name = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{name}"
    return str(exc)


def _where(path: str) -> str:
    """The nearest existing directory of `path` (itself, or a parent when it is not made yet)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def disk_error(root: str, doing: str, exc: BaseException, *, path: str | None = None,
               limit: int | None = None) -> CacheDiskError | None:
    """The CacheDiskError for `exc`, raised while `doing` in cache `root` (writing under `path`
    when known); None when `exc` is not the filesystem refusing a write (a bug, a network
    error: left as it is)."""
    kind = _kind(exc, root)
    if kind is None:
        return None
    named = exc.filename if isinstance(exc, OSError) and isinstance(exc.filename, str) else None
    where = _where(named or path or root)
    limit_words = "" if limit is None else f"; the cache limit is {format_size(limit)}"
    if kind == "full":
        head, advice = "is on a full filesystem", ADVICE_FULL
    elif kind == "io":
        head, advice = "could not be written: the disk reported an I/O error", ADVICE_IO
    elif read_only(where):
        head, advice = "cannot be written: its filesystem is mounted read-only", ADVICE_DENIED
    else:
        head, advice = f"cannot be written by this user (uid {os.getuid()})", ADVICE_DENIED
    return CacheDiskError(
        f"cache directory {root} {head} ({doing}: {_cause(exc)}); {space_words(where)}"
        f"{limit_words}. To fix: {advice}"
    )


@contextlib.contextmanager
def disk_errors(root: str, doing: str, *, path: str | None = None,
                limit: int | None = None) -> Iterator[None]:
    """Raise CacheDiskError (see `disk_error`) for the filesystem refusing a write in the
    block; everything else passes through unchanged."""
    try:
        yield
    except Exception as exc:  # an OSError, or sqlite's OperationalError (see `_kind`)
        if isinstance(exc, CacheDiskError):
            raise
        error = disk_error(root, doing, exc, path=path, limit=limit)
        if error is None:
            raise
        raise error from exc


def make_cache_root(root: str) -> None:
    """Create the cache directory `root` (owner-only) or raise CacheDiskError saying why not."""
    with disk_errors(root, "creating the cache directory"):
        os.makedirs(root, mode=0o700, exist_ok=True)


def check_writable(root: str) -> None:
    """Raise CacheDiskError now when cache directory `root` cannot be written (a read-only
    filesystem, or no write permission), before any worker meets it."""
    if read_only(root):
        exc: OSError = OSError(errno.EROFS, os.strerror(errno.EROFS), root)
    elif not os.access(root, os.W_OK | os.X_OK):
        exc = PermissionError(errno.EACCES, os.strerror(errno.EACCES), root)
    else:
        return
    error = disk_error(root, "checking it before the first read", exc)
    assert error is not None
    raise error


def pending_writes(tmp_dir: str, reserved: dict[str, int]) -> int:
    """Bytes the downloads in flight (`reserved`: cache name -> bytes reserved) have still to
    write: their reservations less what their temp files in `tmp_dir` hold already."""
    if not reserved:
        return 0
    written: dict[str, int] = {}
    try:
        entries = os.listdir(tmp_dir)
    except OSError:
        entries = []
    for entry in entries:
        owner = temp_owner(entry)
        if owner in reserved:
            with contextlib.suppress(OSError):
                written[owner] = written.get(owner, 0) + os.stat(os.path.join(tmp_dir, entry)).st_blocks * 512
    return sum(max(0, size - written.get(name, 0)) for name, size in reserved.items())
