"""Sidecars in the node cache: the small files a read by range needs, shared by the node.

A read by range of a shard the cache does not hold yet needs the shard's range sidecar (and a
tar's offsets sidecar; see `shardloader.source.ranged`). Those are entries of the node cache
like shards, so that every process of the node (ranks, workers, the training process's warm-up
thread) finds what one of them fetched, and the server is asked for each sidecar once per node:

* **Named by content.** `<algorithm>-<digest>.<kind>` under `data/` (`layout.sidecar_name`),
  from the checksum the index gives for the sidecar; an entry is read only when its bytes hash
  to that checksum (a damaged file is discarded and fetched again).
* **One fetcher per node.** A process that misses sidecars takes their download locks (in name
  order, so that processes filling several never wait on each other in a circle), looks again
  (another process may have filled them meanwhile) and fetches what is still missing in one
  round of requests (`FetchRound`, the caller's), verifies it, and commits it: temp file under
  `tmp/`, fsync, rename, ledger entry. The others block on those locks and then read the files.
* **Counted and evictable.** A fill reserves room within the limit as any download does, and a
  committed sidecar is a ledger entry of its own bytes: in `cache_limit`, in the high-water mark,
  evicted least recently used first when a shard needs room, removed by `prune`, checked by
  `verify_all`. It is pinned (a shared `flock`) only while a process reads its bytes (a reader
  keeps the decoded table in memory); after that it is evictable whatever its shard is doing:
  the next reader that needs it fetches it again, once per node again.
* **Never in the way.** A fill does not wait for room: when none can be made at once (every
  byte pinned by readers, or the filesystem full), the sidecar fetched is used by the process
  that fetched it (in memory) and not kept on the node; the other processes fetch it themselves.
* **Off a first batch's path.** The ledger is needed only to reserve room and commit, and a
  cold first batch needs neither: the sidecars `prime` fetches for it (and those fetched for it
  in the background from `Loader()`) are committed once it is out (`load_sidecars(hold=...)`),
  their download locks held until then. Its sidecar round was ~50 ms without workers and ~90
  with two, of which the requests took 20-30: the ledger's first opening (then diskcache's
  import, sqlite, reconciling) and 8 commits, on a client whose CPU the round shares with the workers'
  warm-up imports. Opening the ledger in a thread while the requests were in flight, or
  committing while the spans were fetched, saved nothing (the client's CPU is what they share).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardloader.cache.download import temp_files
from shardloader.cache.ledger import LedgerEntry, Reservation
from shardloader.cache.locks import FILE_MODE, close_fd, exclusive, pin_file
from shardloader.cache.room import make_room
from shardloader.cache.shard_files import remove_temps
from shardloader.cache.space import disk_errors
from shardloader.cache.store import ShardCache
from shardloader.errors import CacheDiskError
from shardloader.io.checksum import checksum_bytes, parse_checksum
from shardloader.io.files import fsync_dir
from shardloader.units import format_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SidecarWant:
    """A sidecar as its shard's index entry describes it."""

    name: str  # its cache name (`layout.sidecar_name`)
    bytes: int
    checksum: str
    what: str  # names it in messages (its URL)


#: Fetch the sidecars given, all in one round of requests: each one's bytes, or None for one that
#: could not be fetched or does not match its index entry (the callback says why, as it sees fit).
FetchRound = Callable[[list[SidecarWant]], list["bytes | None"]]


def matches(data: bytes, want: SidecarWant) -> bool:
    """True when `data` is the sidecar the index describes (size and checksum)."""
    return len(data) == want.bytes and checksum_bytes(data, parse_checksum(want.checksum)[0]) == want.checksum


def cached_sidecar(cache: ShardCache, want: SidecarWant) -> bytes | None:
    """The bytes of `want` when the node cache holds it and they verify, after waiting for a
    fill of it in flight (its download lock: a commit held for a first batch, see
    `load_sidecars`); None otherwise (a file that does not verify is discarded, to be fetched
    again). Lock order: a caller may hold a shard's download lock, never a sidecar's."""
    _ = cache.ledger  # open (and reconcile) before any lock is taken
    data = _read(cache, want, locked=False)
    if data is not None:
        return data
    with disk_errors(cache.root, "taking the download lock of a range sidecar", path=cache.layout.lock_dir), \
            exclusive(cache.layout.lock_of(want.name)):
        return _read(cache, want, locked=True)


#: A commit held for a first batch (`load_sidecars(hold=...)`) waits at most this long for its
#: batch: the sidecars' download locks are held meanwhile (other processes wait for the files).
HOLD_SECONDS = 5.0


def load_sidecars(cache: ShardCache, wants: Sequence[SidecarWant], fetch: FetchRound, *,
                  hold: threading.Event | None = None) -> list[bytes | None]:
    """The verified bytes of each of `wants`, from the node cache, else fetched by `fetch` (one
    round for all this process must fetch) under their download locks and committed to the
    cache; None for those that could not be had (not fetched, not matching).

    `hold`: what is fetched is returned at once and committed by a daemon thread once `hold` is
    set (a Loader's first batch is out), or after `HOLD_SECONDS`; the download locks stay held
    until then, so other processes wait for the files rather than fetch them. A cold first batch
    then does not wait for the ledger's first opening and 8 commits (20-40 ms of its sidecar
    round, `benchmarks/coldstart.py`): its workers inherit the bytes, and what needs the files
    on the node comes later. A commit that fails there is logged (a warning); without `hold`
    it raises here.

    Raises CacheDiskError when the cache's filesystem refuses a write (naming the cache, the
    sidecar and the free space); `fetch`'s own errors pass through."""
    out = [_read(cache, want, locked=False) for want in wants]
    missing = {want.name: want for want, data in zip(wants, out) if data is None}
    if not missing:
        return out
    filled = _fill(cache, [missing[name] for name in sorted(missing)], fetch, hold)
    return [filled.get(want.name) if data is None else data for want, data in zip(wants, out)]


def _fill(cache: ShardCache, wants: list[SidecarWant], fetch: FetchRound,
          hold: threading.Event | None) -> dict[str, bytes]:
    """Fetch `wants` (sorted by name) under their download locks and commit them (later, with
    `hold`, by a thread that then releases the locks); what was had."""
    found: dict[str, bytes] = {}
    with contextlib.ExitStack() as locks:
        with disk_errors(cache.root, "taking the download locks of range sidecars", path=cache.layout.lock_dir):
            for want in wants:  # in name order: no two fillers wait on each other in a circle
                locks.enter_context(exclusive(cache.layout.lock_of(want.name)))
        todo = []
        for want in wants:
            data = _read(cache, want, locked=True)  # another process may have filled it
            if data is not None:
                found[want.name] = data
                continue
            remove_temps(cache.layout, want.name)  # a dead filler's leftovers
            todo.append(want)
        if not todo:
            return found
        fetched = [(want, data) for want, data in zip(todo, fetch(todo)) if data is not None and matches(data, want)]
        found.update((want.name, data) for want, data in fetched)
        if hold is None or not fetched:
            _commit_all(cache, fetched)
        else:
            threading.Thread(target=_commit_held, args=(cache, fetched, locks.pop_all(), hold),
                             name="shardloader-sidecar-commit", daemon=True).start()
    return found


def _commit_held(cache: ShardCache, fetched: list[tuple[SidecarWant, bytes]], locks: contextlib.ExitStack,
                 hold: threading.Event) -> None:
    """`_commit_all` once `hold` is set (at most `HOLD_SECONDS` from now), then release `locks`."""
    with locks:
        hold.wait(HOLD_SECONDS)
        try:
            _commit_all(cache, fetched)
        except Exception as e:  # noqa: BLE001 - a background thread: said, not raised
            log.warning("cache %s: could not keep range sidecars on the node (the processes that need "
                        "them fetch them again): %s", cache.root, e)


def _commit_all(cache: ShardCache, fetched: list[tuple[SidecarWant, bytes]]) -> None:
    """Reserve room for and commit each verified sidecar of `fetched` (caller holds their
    download locks); one without room now is left out (its bytes serve the caller only)."""
    if not fetched:
        return
    _ = cache.ledger  # open (and reconcile) first: reserving takes the bookkeeping lock
    reserved: list[str] = []
    committed: set[str] = set()
    try:
        for want, data in fetched:
            if not _reserve_now(cache, want):
                continue
            reserved.append(want.name)
            _commit(cache, want, data)
            committed.add(want.name)
    finally:
        left = [name for name in reserved if name not in committed]
        if left:
            try:
                with cache.bookkeeping():
                    for name in left:
                        cache.ledger.release_reservation(name)
            except CacheDiskError:  # the next room-making pass drops them (their locks free)
                log.debug("cache %s: reservations of sidecars left", cache.root, exc_info=True)


def _read(cache: ShardCache, want: SidecarWant, *, locked: bool) -> bytes | None:
    """`want`'s bytes from the cache if they verify, its access recorded; a file that does not
    verify is removed (`locked`: the caller holds its download lock)."""
    path = cache.path_of(want.name)
    if not os.path.exists(path):
        return None  # not on the node: no ledger needed (a cold start's path)
    ledger = cache.ledger  # before any lock (the pin; `discard` takes the bookkeeping lock)
    fd = pin_file(path)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        data = _read_fd(fd, want.bytes + 1)
    finally:
        close_fd(fd)
    if matches(data, want):
        try:
            ledger.touch(want.name, time.time(), opened=True)
        except Exception:  # noqa: BLE001 - advisory (LRU order), never fails a read
            log.debug("cache %s: could not record an access to %s", cache.root, want.name, exc_info=True)
        return data
    if len(data) != want.bytes:
        why = f"{st.st_size} bytes, the index says {want.bytes}"
    else:
        algorithm = parse_checksum(want.checksum)[0]
        why = f"checksum {checksum_bytes(data, algorithm)}, the index says {want.checksum}"
    log.warning("%s: cached sidecar %s (inode %d) failed verification: %s; discarding it and "
                "fetching again", want.what, path, st.st_ino, why)
    if locked:
        _remove(cache, want.name, (st.st_ino, st.st_dev))
    else:
        cache.discard(want.name, (st.st_ino, st.st_dev))
    return None


def _read_fd(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.pread(fd, limit - size, size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _remove(cache: ShardCache, name: str, identity: tuple[int, int]) -> None:
    """Remove a damaged sidecar (caller holds its download lock), unless it was replaced."""
    path = cache.path_of(name)
    with disk_errors(cache.root, f"removing the damaged sidecar {path}", path=path):
        cache.discard_locked(name, identity)


def _reserve_now(cache: ShardCache, want: SidecarWant) -> bool:
    """Reserve room for `want` within the limit (and the filesystem's free space), evicting
    least recently used unpinned entries and this process's idle readers' pins; False, without
    waiting, when that makes no room (the sidecar is then not kept on the node)."""
    if want.bytes > cache.limit:
        return False
    for _ in range(2):
        with disk_errors(cache.root, f"reserving room for the sidecar {want.what}", limit=cache.limit), \
                cache.bookkeeping():
            shortage = make_room(cache, want.name, want.bytes)
            if shortage is None:
                cache.ledger.reserve(want.name, Reservation(want.bytes, os.getpid()))
                return True
        if not (shortage.pinned_here and cache.release_idle()):
            break
    log.info("cache %s: no room now for the sidecar %s (%s): %s pinned by readers of this process, "
             "%s by others, %s in downloads in flight; reading its shard whole", cache.root, want.what,
             format_size(want.bytes), format_size(shortage.pinned_here),
             format_size(shortage.pinned_elsewhere), format_size(shortage.reserved))
    return False


def _commit(cache: ShardCache, want: SidecarWant, data: bytes) -> None:
    """Write verified `data` to a temp file, fsync it, rename it into place and record it
    (caller holds its download lock and its reservation)."""
    path = cache.path_of(want.name)
    doing = f"writing the sidecar {want.what} ({format_size(want.bytes)}) into {cache.layout.tmp_dir}"
    with disk_errors(cache.root, doing, path=cache.layout.tmp_dir, limit=cache.limit), \
            temp_files(cache.layout, want.name) as new_temp:
        tmp = new_temp()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with cache.bookkeeping():
            os.rename(tmp, path)
            now = time.time()
            cache.ledger.commit(want.name, LedgerEntry(want.bytes, now))
            cache.ledger.touch(want.name, now, opened=True)  # read now: an ordinary LRU entry
        fsync_dir(os.path.dirname(path))


__all__ = ["FetchRound", "SidecarWant", "cached_sidecar", "load_sidecars",
           "matches"]
