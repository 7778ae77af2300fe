"""Scenarios of tests/test_cache_disk.py, run in a child process that has a mount namespace of
its own (`unshare -m`; `-rm` when not root), so that it can mount a small tmpfs, make it
read-only, and leave nothing mounted when it exits. Each scenario prints one JSON report as its
last line.

    python -m tests.cache_disk_child <scenario> <dataset dir> <mount point> [<chmod|mount>]
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
from typing import Any

FS_BYTES = 8 << 20  # the small filesystem: 8 MiB


def _sh(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)}: {proc.stderr.strip()}")


def mount_tmpfs(where: str, size: int = FS_BYTES) -> None:
    os.makedirs(where, exist_ok=True)
    _sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where)


def make_read_only(path: str, how: str) -> None:
    """`mount`: remount the filesystem at `path` read-only (works for root too); `chmod`: take
    write permission away (only stops a user that is not root)."""
    if how == "mount":
        _sh("mount", "-o", "remount,ro", path)
        return
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            os.chmod(full, stat.S_IMODE(os.lstat(full).st_mode) & ~0o222)
    os.chmod(path, 0o555)


def read_only_dir(path: str, how: str) -> None:
    """Make the directory `path` alone read-only: a read-only bind mount of it onto itself
    (`mount`), or its write permission taken away (`chmod`)."""
    if how == "mount":
        _sh("mount", "--bind", path, path)
        _sh("mount", "-o", "remount,bind,ro", path)
    else:
        os.chmod(path, 0o555)
        for name in os.listdir(path):
            os.chmod(os.path.join(path, name), 0o444)


def fill(path: str, leave: int = 0) -> int:
    """Write a file under `path` until its filesystem has `leave` bytes free (or none);
    bytes written."""
    written = 0
    with open(os.path.join(path, "filler"), "wb") as f:
        chunk = b"\0" * (64 << 10)
        while True:
            st = os.statvfs(path)
            room = st.f_bavail * st.f_frsize - leave
            if room <= 0:
                break
            try:
                f.write(chunk[: max(4096, min(len(chunk), room))])
                f.flush()
            except OSError:
                break
            written += min(len(chunk), room)
    return written


def _error(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)}


def _loader(url: str, cache: str, **kw: Any) -> Any:
    from shardloader import Dataset, Loader

    return Loader(Dataset(url, cache_dir=cache, **kw), batch_size=8, num_workers=2, seed=3, timeout=120)


def _epoch(loader: Any) -> dict[str, Any]:
    labels: list[int] = []
    try:
        for batch in loader:
            labels.extend(int(x) for x in batch["label"])
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"batches": len(labels) // 8, "error": _error(exc)}
    finally:
        loader.close()
    return {"batches": len(labels) // 8, "labels": sorted(labels), "error": None}


def read_only_cache(url: str, mnt: str, how: str) -> dict[str, Any]:
    """Caches on a read-only filesystem: an empty directory, one holding shards, one that does
    not exist yet, and a Dataset read without a Loader (the cache opened deep in a read)."""
    from shardloader import Dataset

    if how == "mount":
        mount_tmpfs(mnt, 64 << 20)
    os.makedirs(os.path.join(mnt, "empty"))
    ds = Dataset(url, cache_dir=os.path.join(mnt, "full"), cache_limit="20MB")
    ds[0], ds[len(ds) - 1]  # two shards cached, with their ledger
    ds.close()
    ds.source.close()  # nothing open for writing: the remount needs that
    make_read_only(mnt, how)
    report: dict[str, Any] = {}
    for name in ("empty", "full"):
        report[name] = _epoch(_loader(url, os.path.join(mnt, name), cache_limit="20MB"))
    try:
        Dataset(url, cache_dir=os.path.join(mnt, "new", "cache"), cache_limit="20MB")
        report["new"] = None
    except Exception as exc:  # noqa: BLE001
        report["new"] = _error(exc)
    try:
        Dataset(url, cache_dir=os.path.join(mnt, "full"), cache_limit="20MB")[5]
        report["no_loader"] = None
    except Exception as exc:  # noqa: BLE001
        report["no_loader"] = _error(exc)
    return report


def read_only_ledger(url: str, mnt: str, how: str) -> dict[str, Any]:
    """A cache whose ledger directory alone is read-only: the check before the workers passes,
    and sqlite refuses inside a worker."""
    from shardloader import Dataset

    cache = os.path.join(mnt, "cache")
    ds = Dataset(url, cache_dir=cache, cache_limit="20MB")
    ds[0]
    ds.close()
    ds.source.close()
    read_only_dir(os.path.join(cache, "index"), how)
    return _epoch(_loader(url, cache, cache_limit="20MB"))


def small_filesystem(url: str, mnt: str, filler: int, size: int = FS_BYTES) -> dict[str, Any]:
    """The default cache_limit on a `size` tmpfs (80% of its free space when the Dataset is
    made); then `filler` bytes of other files written before the epoch starts."""
    from shardloader import Dataset, Loader

    mount_tmpfs(mnt, size)
    cache = os.path.join(mnt, "cache")
    ds = Dataset(url, cache_dir=cache)
    if filler:
        with open(os.path.join(mnt, "other-files"), "wb") as f:
            f.write(os.urandom(filler))
    report = _epoch(Loader(ds, batch_size=8, num_workers=2, seed=3, timeout=120))
    report["limit"] = ds.source.cache_limit
    report["node"] = ds.source.node_counters()
    st = os.statvfs(mnt)
    report["free_after"] = st.f_bavail * st.f_frsize
    return report


def full_during_download(url: str, mnt: str) -> dict[str, Any]:
    """Another writer fills the filesystem while a shard downloads (100 KB left of the 489 KiB
    it needs): a short write, then the kernel's ENOSPC (today: a "checksum mismatch" blaming
    the remote object, the short writes' holes hashed)."""
    from shardloader.cache.store import ShardCache
    from shardloader.source.remote import RemoteSource

    mount_tmpfs(mnt)
    src = RemoteSource(url, cache_dir=os.path.join(mnt, "cache"), cache_limit="1GB", prefetch=False)
    info = src_index(url).shards[1]
    fetch, companions = src.plan(info)

    def fetch_after_filling(fd: int, cancel: Any) -> Any:
        fill(mnt, leave=100_000)  # room for part of the shard: a short write, then ENOSPC
        return fetch(fd, cancel)

    store: ShardCache = src.store
    report: dict[str, Any] = {"shard": info.path}
    try:
        store.open(info, fetch_after_filling, companions)
        report["error"] = None
    except Exception as exc:  # noqa: BLE001
        report["error"] = _error(exc)
    report["temps"] = os.listdir(store.layout.tmp_dir)
    report["size"] = info.bytes
    os.unlink(os.path.join(mnt, "filler"))
    report["after"] = bool(store.open(info, fetch, companions))  # space back: it works again
    report["reserved"] = sorted(store.ledger.reservations())  # a reservation left was dropped
    return report


def no_room_on_disk(url: str, mnt: str) -> dict[str, Any]:
    """Other files leave less room than a shard: a reader's download is refused before a byte
    is written, naming the free space (today: the kernel's ENOSPC, or sqlite's "database or
    disk is full")."""
    from shardloader.source.remote import RemoteSource

    mount_tmpfs(mnt)
    src = RemoteSource(url, cache_dir=os.path.join(mnt, "cache"), full_timeout=0.5, prefetch=False)
    info = src_index(url).shards[0]
    src.store.ledger  # noqa: B018 - the cache opened (its ledger made) while there was room
    fill(mnt, leave=200_000)  # less than the shard (489 KiB), and than DISK_MARGIN
    report: dict[str, Any] = {"shard": info.path, "limit": src.cache_limit}
    try:
        src.local_path(info)
        report["error"] = None
    except Exception as exc:  # noqa: BLE001
        report["error"] = _error(exc)
    report["temps"] = os.listdir(os.path.join(mnt, "cache", "tmp"))
    return report


def full_ledger(mnt: str) -> dict[str, Any]:
    """The ledger's sqlite on a filesystem with no space left."""
    from shardloader.cache.ledger import Ledger, LedgerEntry

    mount_tmpfs(mnt, 1 << 20)
    ledger = Ledger(os.path.join(mnt, "cache", "index"))
    ledger.commit("xxh3_128-" + "0" * 32 + ".arrow", LedgerEntry(1, 0.0))
    fill(mnt)
    for i in range(100_000):
        try:
            ledger.commit(f"xxh3_128-{i:032x}.arrow", LedgerEntry(12345, float(i)))
        except Exception as exc:  # noqa: BLE001
            return {"writes": i, "error": _error(exc)}
    return {"writes": 100_000, "error": None}


def src_index(url: str) -> Any:
    from shardloader.source.index import load_index

    return load_index(url, {})


def main(scenario: str, dataset: str, mnt: str, how: str = "mount") -> None:
    from tests.fixtures.servers import HTTPServer

    server = HTTPServer(dataset)
    try:
        if scenario == "read-only":
            report = read_only_cache(server.url, mnt, how)
        elif scenario == "read-only-ledger":
            if how == "mount":
                mount_tmpfs(mnt, 64 << 20)
            report = read_only_ledger(server.url, mnt, how)
        elif scenario == "small-fs":
            report = small_filesystem(server.url, mnt, 0)
        elif scenario == "small-fs-shared":  # room for the ledger's 4 MiB write-ahead log
            report = small_filesystem(server.url, mnt, 6 << 20, 16 << 20)
        elif scenario == "full-download":
            report = full_during_download(server.url, mnt)
        elif scenario == "no-room":
            report = no_room_on_disk(server.url, mnt)
        elif scenario == "full-ledger":
            report = full_ledger(mnt)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    finally:
        with contextlib.suppress(Exception):
            server.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
