"""A node cache on a read-only or full filesystem (issue 25, item 12): one CacheDiskError naming
the cache directory, what was being written and the filesystem's free space, never sqlite's or
the kernel's bare words from inside a worker; and a cache that never plans beyond the free
space of its filesystem, so that the default cache_limit on a small filesystem evicts instead
of filling it.

Real filesystems: each scenario runs in a child with a mount namespace of its own
(tests/cache_disk_child.py), on a small tmpfs it mounts (8 MiB; 1 MiB for the ledger alone),
made read-only by a remount (or a read-only bind mount of one directory). Root ignores file
permissions, so `chmod` would not stop its writes: a read-only mount does, for root and anyone.
The read-only scenarios run twice: on a read-only mount (stops root too) and by `chmod` (for
root, in a child that `setpriv` stripped of CAP_DAC_OVERRIDE, without which chmod binds root as
well). Where mount namespaces are unavailable the `mount` variants skip, saying so; the
full-filesystem scenarios run in the `mount` variant only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from shardloader.cache.space import DISK_MARGIN
from shardloader.ingest.writer import write_shards
from shardloader.units import format_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARDS, SHARD_SAMPLES, SAMPLE_BYTES = 24, 20, 25_000  # 24 shards of 500 KB: 12 MB > 8 MiB


def _unshare() -> list[str]:
    return ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]


def _mounts_work(tmp_path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        [*_unshare(), "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
        capture_output=True, timeout=60,
    )
    return probe.returncode == 0


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("disk-ds") / "ds")
    rng = np.random.default_rng(5)
    samples = ({"data": rng.integers(0, 256, SAMPLE_BYTES, dtype=np.uint8).tobytes(), "label": i}
               for i in range(SHARDS * SHARD_SAMPLES))
    write_shards(samples, path, shard_samples=SHARD_SAMPLES)
    return path


def _setpriv_works() -> bool:
    """Root can drop CAP_DAC_OVERRIDE for a child (`setpriv`): chmod then stops it too."""
    if not shutil.which("setpriv"):
        return False
    probe = subprocess.run(["setpriv", *_NO_OVERRIDE, "true"], capture_output=True, timeout=60)
    return probe.returncode == 0


_NO_OVERRIDE = ("--bounding-set=-dac_override,-dac_read_search",)


@pytest.fixture(scope="module")
def mounts(tmp_path_factory) -> bool:
    return _mounts_work(tmp_path_factory.mktemp("probe"))


@pytest.fixture(scope="module", params=["mount", "chmod"])
def how(request, mounts):
    """How a directory is made read-only: `mount` (a read-only remount or bind mount in a
    private mount namespace: stops root too), or `chmod` (write permission taken away; for root
    the child runs without CAP_DAC_OVERRIDE, which otherwise lets root write anyway)."""
    if request.param == "mount" and not mounts:
        pytest.skip("mount namespaces are unavailable here: no read-only or small tmpfs mount")
    if request.param == "chmod" and os.geteuid() == 0 and not _setpriv_works():
        pytest.skip("root ignores chmod, and setpriv cannot drop CAP_DAC_OVERRIDE here")
    return request.param


def run(scenario: str, dataset: str, mnt, how: str) -> dict:
    mnt.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "tests.cache_disk_child", scenario, dataset, str(mnt), how]
    if how == "mount":
        command = [*_unshare(), *command]
    elif os.geteuid() == 0:
        command = ["setpriv", *_NO_OVERRIDE, *command]
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        if how == "chmod":  # give write permission back, so that pytest can remove the files
            subprocess.run(["chmod", "-R", "u+w", str(mnt)], capture_output=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def tmpfs(mounts) -> str:
    """The way the full-filesystem scenarios run: a small tmpfs in a mount namespace."""
    if not mounts:
        pytest.skip("mount namespaces are unavailable here: no small tmpfs to fill")
    return "mount"


def test_read_only_cache_is_one_clear_error_before_any_worker(dataset, tmp_path, how):
    report = run("read-only", dataset, tmp_path / "mnt", how)
    mnt = str(tmp_path / "mnt")
    state = "its filesystem is mounted read-only" if how == "mount" else "by this user"
    for name in ("empty", "full"):  # an empty directory, one holding shards and their ledger
        got = report[name]
        assert got["batches"] == 0 and got["error"]["type"] == "CacheDiskError", got
        message = got["error"]["message"]
        assert message.startswith(f"cache directory {os.path.join(mnt, name)} cannot be written")
        assert state in message and "worker" not in message  # before the workers, in this process
        assert "; its filesystem has " in message and " free of " in message
        assert "point cache_dir (or $SHARDLOADER_CACHE_DIR) at a local directory" in message
    new = report["new"]  # a cache directory that cannot be made
    assert new["type"] == "CacheDiskError"
    assert new["message"].startswith(f"cache directory {os.path.join(mnt, 'new', 'cache')} cannot be written")
    assert "creating the cache directory" in new["message"]
    read = report["no_loader"]  # a Dataset read alone: the ledger's sqlite refuses to open
    assert read["type"] == "CacheDiskError"
    assert read["message"].startswith(f"cache directory {os.path.join(mnt, 'full')} cannot be written")
    assert f"opening its ledger in {os.path.join(mnt, 'full', 'index')}" in read["message"]
    assert "OperationalError" not in read["message"]


def test_read_only_ledger_fails_in_the_worker_naming_the_cache(dataset, tmp_path, how):
    """The cache directory is writable but its ledger's directory is not: sqlite's "unable to
    open database file" in a worker becomes a CacheDiskError naming the ledger."""
    report = run("read-only-ledger", dataset, tmp_path / "mnt", how)
    error = report["error"]
    assert report["batches"] == 0 and error["type"] == "CacheDiskError", report
    cache = str(tmp_path / "mnt" / "cache")
    assert "in shardloader worker process" in error["message"]
    assert f"cache directory {cache} cannot be written" in error["message"]
    assert f"its ledger in {os.path.join(cache, 'index')}" in error["message"]
    if how == "mount":
        assert "its filesystem is mounted read-only" in error["message"]


@pytest.mark.parametrize("scenario,fs,filler", [("small-fs", 8 << 20, 0),
                                                ("small-fs-shared", 16 << 20, 6 << 20)])
def test_default_limit_on_a_small_filesystem_never_fills_it(dataset, tmp_path, tmpfs, scenario,
                                                           fs, filler):
    """The default cache_limit (80% of the free space when the Dataset is made) on an 8 MiB
    tmpfs; `small-fs-shared`: on a 16 MiB one (12.8 MiB limit), then 6 MiB of other files land
    on it before the epoch, leaving less than the limit (and the ledger's write-ahead log, at
    sqlite's default checkpointing, takes up to 4 MiB more). Today the first fills the disk
    (the log on top of the shards) and the second crashes at once; now both read the whole
    epoch, evicting within the free space."""
    report = run(scenario, dataset, tmp_path / "mnt", tmpfs)
    assert report["error"] is None, report["error"]
    assert report["labels"] == list(range(SHARDS * SHARD_SAMPLES))
    assert report["limit"] == int(fs * 0.8)
    assert report["free_after"] > 0
    node = report["node"]
    assert node["evictions"] > 0 and node["high_water"] <= report["limit"]
    if filler:  # the free space, not the limit, bounded the cache
        assert node["high_water"] <= fs - filler - DISK_MARGIN


def test_disk_filled_during_a_download_names_the_shard_and_free_space(dataset, tmp_path, tmpfs):
    report = run("full-download", dataset, tmp_path / "mnt", tmpfs)
    error = report["error"]
    cache = str(tmp_path / "mnt" / "cache")
    assert error["type"] == "CacheDiskError", error
    message = error["message"]
    assert message.startswith(
        f"cache directory {cache} is on a full filesystem (downloading shard {report['shard']} "
        f"({format_size(report['size'])}) into {cache}/tmp: No space left on device)")
    assert re.search(r"; its filesystem has \d+\.\d KiB free of 8\.0 MiB; the cache limit is "
                     r"953\.7 MiB\. ", message), message
    assert message.endswith("To fix: free space there, lower cache_limit, or point cache_dir (or "
                            "$SHARDLOADER_CACHE_DIR) at a filesystem with room")
    assert report["temps"] == []  # nothing half-made is left
    assert report["after"] and report["reserved"] == []  # space back: the same read works


def test_no_room_left_by_other_files_is_refused_before_writing(dataset, tmp_path, tmpfs):
    """Other files leave the filesystem 200 KB free, less than a shard: the download is refused
    at once (nothing written), naming the free space, not the limit."""
    report = run("no-room", dataset, tmp_path / "mnt", tmpfs)
    error = report["error"]
    assert error is not None and error["type"] == "CacheFullError", report
    cache = str(tmp_path / "mnt" / "cache")
    assert error["message"].startswith(
        f"cache {cache}: no room for shard {report['shard']} (") and "on the cache's filesystem: " \
        "it has " in error["message"]
    assert f"less {format_size(DISK_MARGIN)} the cache leaves for its ledger: " in error["message"]
    assert f"(the cache limit, {format_size(report['limit'])}, is not reached)" in error["message"]
    assert "free space on that filesystem, lower num_workers" in error["message"]
    assert report["temps"] == []


def test_full_filesystem_under_the_ledger(dataset, tmp_path, tmpfs):
    report = run("full-ledger", dataset, tmp_path / "mnt", tmpfs)
    error = report["error"]
    assert error is not None, report
    index = str(tmp_path / "mnt" / "cache" / "index")
    assert error["type"] == "CacheDiskError"
    assert error["message"].startswith(f"cache directory {os.path.dirname(index)} is on a full filesystem "
                                       f"(writing the ledger record 'entry/xxh3_128-")
    assert f"in {index}: database or disk is full)" in error["message"]
    assert "its filesystem has " in error["message"] and "free of 1.0 MiB" in error["message"]
