"""Shards that change under a run (I9, I12): replaced by rename, truncated or rewritten in place.

Each run below iterates a Loader over a private copy of a dataset, mutates one shard right after
batch k was received, and goes on. Every batch it delivers must equal, byte for byte, the batch
an untouched dataset gives at that position; the only other allowed outcome is an error naming
the changed file. The run happens in a child process so that a death by signal (SIGBUS from a
memory-mapped page past the end of a truncated file, today's failure) is seen as the child's exit
status instead of taking pytest down. `max_open_shards=1` with a shuffle window of 2 makes every
process close and reopen shards all the time, which is where a check by path used to be fooled;
`_plan` picks k and the shard from the epoch's order so that the change meets an open memory map
(truncate, overwrite) or a reopen (rename) in a process that verified the shard before.

With worker processes the mutation is synchronised with the iteration, not timed: the test's
transform holds every worker inside its next batch (rows already read) until the shard has been
mutated, so no worker is between reading pages when the file changes.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import traceback
from typing import Any

import numpy as np
import pytest

from shardloader import Dataset, Loader
from shardloader.errors import ChecksumMismatch, ShardChangedError, ShardError
from shardloader.format.arrow import ArrowShardReader
from shardloader.format.parquet import ParquetShardReader
from shardloader.format.registry import open_shard
from shardloader.format.tar import TarShardReader
from shardloader.ingest.writer import write_shards
from shardloader.io.identity import FileGuard, FileIdentity, path_identity
from tests.fixtures.data import copy_dataset, make_samples
from tests.resume import record

BATCH = 2
CHILD_SECONDS = 120


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    """64 samples in 4 Arrow shards of 16, and a same-shaped dataset with other content."""
    base = tmp_path_factory.mktemp("changing")
    write_shards(make_samples(64, seed=11), str(base / "ds"), shard_samples=16)
    write_shards(make_samples(64, seed=12), str(base / "other"), shard_samples=16)
    return str(base / "ds"), str(base / "other")


def _loader(root: str, num_workers: int, transform: Any = None) -> Loader:
    return Loader(Dataset(root, max_open_shards=1), batch_size=BATCH, shuffle=True, seed=3, window=2,
                  partitions=1, num_workers=num_workers, prefetch_factor=2 if num_workers else None,
                  transform=transform)


class _Gate:
    """Identity transform that holds each worker at its first sample of a batch after k until
    the test opens the gate, saying on `arrived` that it is there."""

    uses_global_rng = False

    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.arrived = multiprocessing.get_context("fork").Queue()
        self.go = multiprocessing.get_context("fork").Event()

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if not self.go.is_set() and sample["__index__"] in self.held:
            self.arrived.put(os.getpid())
            if not self.go.wait(CHILD_SECONDS):
                raise TimeoutError("the test never opened the gate")
        return sample


def _mutate(kind: str, path: str, other: str) -> None:
    if kind == "rename":  # another file with the same rows and schema, renamed over the shard
        shutil.copyfile(other, path + ".new")
        os.replace(path + ".new", path)
    elif kind == "rename_identical":  # a new inode with the very same bytes: must keep working
        shutil.copyfile(path, path + ".new")
        os.replace(path + ".new", path)
    elif kind == "truncate":
        os.truncate(path, os.path.getsize(path) // 3)
    elif kind == "overwrite":  # same size, other bytes, in place
        size = os.path.getsize(path)
        with open(other, "rb") as src, open(path, "r+b") as dst:
            dst.write(src.read()[:size].ljust(size, b"\0"))
    elif kind == "overwrite_mtime_kept":  # the same, and the mtime put back (rsync --inplace -t)
        size = os.path.getsize(path)
        with open(other, "rb") as src:
            rewrite_keeping_mtime(path, src.read()[:size].ljust(size, b"\0"))
    else:
        raise AssertionError(kind)


def rewrite_keeping_mtime(path: str, data: bytes) -> None:
    """Write `data` (as long as the file) over `path` in place and put its mtime back, as
    `rsync --inplace --times` or `touch -r` do: size, inode and mtime stay; only the inode
    change time, which users cannot set, moves. Written again while the kernel's coarse clock
    has not ticked since the file's last change (the change time would not show it)."""
    st = os.stat(path)
    assert len(data) == st.st_size
    while True:
        with open(path, "r+b") as f:
            f.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        now = os.stat(path)
        if now.st_ctime_ns != st.st_ctime_ns:
            break
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def _plan(order: list[tuple[int, ...]], offsets: np.ndarray, kind: str,
          num_workers: int) -> tuple[int, int]:
    """(k, shard): change `shard` right after batch k is received, chosen from the epoch's
    order so that the change meets a process that verified the shard before.

    A process reads a batch's shards in ascending order and keeps only the last one open
    (`max_open_shards=1`); inline, the next batch is its own, with two workers a worker's
    next batch is two further on (tasks are dealt round-robin), and the worker parked in batch
    k+1 is the one whose reader is checked. In-place changes (truncate, overwrite) go to the
    shard that process holds open and reads first next: the open memory map meets the change.
    Renames go to a shard it read, closed, and reads again later: the reopen meets it.
    """
    shards = [sorted({int(np.searchsorted(offsets, i, side="right") - 1) for i in b}) for b in order]
    lag, step = (1, num_workers) if num_workers else (0, 1)
    for k in range(1, len(order) - lag - step):
        mine = shards[k + lag]
        later = shards[k + lag + step::step]
        if kind in ("truncate", "overwrite", "overwrite_mtime_kept"):
            if later[0][0] == mine[-1]:
                return k, mine[-1]
        elif mine[0] != mine[-1] and any(mine[0] in s for s in later):
            return k, mine[0]
    raise AssertionError(f"no batch of this order suits a {kind} with {num_workers} workers")


def _run(conn: Any, root: str, other_root: str, kind: str, num_workers: int,
         reference: list[Any]) -> None:
    """In the child: iterate, mutate after batch k, report (delivered, wrong positions, error,
    the changed file)."""
    loader = None
    try:
        order = [b.indices for b in reference]
        k, shard = _plan(order, Dataset(root).index.sample_offsets, kind, num_workers)
        name = f"shard-{shard:05d}.arrow"
        gate = _Gate({batch[0] for batch in order[k + 1:]}) if num_workers else None
        loader = _loader(root, num_workers, gate)
        wrong, error = [], None
        delivered = 0
        try:
            for i, batch in enumerate(loader):
                delivered += 1
                if record(batch) != reference[i]:
                    wrong.append(i)
                if i == k:
                    if gate is not None:  # every worker is parked inside its next batch
                        for _ in range(num_workers):
                            gate.arrived.get(timeout=CHILD_SECONDS)
                    _mutate(kind, os.path.join(root, name), os.path.join(other_root, name))
                    if gate is not None:
                        gate.go.set()
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = f"{type(e).__name__}: {e}"
        conn.send((delivered, wrong, error, os.path.join(root, name)))
    except BaseException:  # noqa: BLE001
        conn.send((0, [], "test harness failed: " + traceback.format_exc(), ""))
    finally:
        if loader is not None:
            loader.close()
        conn.close()


def _in_child(target: Any, *args: Any) -> Any:
    """`target(conn, *args)` in a forked child; what it sent, after checking that it exited
    normally (a negative exit status is a death by signal, e.g. SIGBUS)."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(theirs, *args))
    child.start()
    theirs.close()
    try:
        got = ours.recv() if ours.poll(CHILD_SECONDS) else None
    except EOFError:  # the child died without reporting
        got = None
    child.join(CHILD_SECONDS)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, f"the run died with exit status {child.exitcode} (negative: a signal)"
    assert got is not None, "the run reported nothing"
    return got


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["rename", "truncate", "overwrite", "overwrite_mtime_kept",
                                  "rename_identical"])
def test_shard_changed_during_epoch_is_correct_data_or_an_error_naming_it(
        small_dataset, tmp_path, kind, num_workers):
    ds_root, other_root = small_dataset
    reference_loader = _loader(ds_root, 0)
    reference = [record(b) for b in reference_loader]
    assert len(reference) == 32
    root = copy_dataset(ds_root, tmp_path)
    delivered, wrong, error, changed = _in_child(_run, root, other_root, kind, num_workers, reference)
    assert error is None or not error.startswith("test harness"), error
    assert wrong == [], f"batches {wrong} were delivered with wrong samples ({error=})"
    if kind == "rename_identical":
        assert (delivered, error) == (len(reference), None)  # verified again, and it matches
    else:
        # The changed shard holds samples of later batches: they cannot all come out right.
        assert error is not None and changed in error, error
        assert "ShardError" in error or "ChecksumMismatch" in error or "ShardChangedError" in error


def _read_after_truncation(conn: Any, root: str, path: str) -> None:
    ds = Dataset(root)
    ds[50]  # opens part-1
    os.truncate(path, 4096)
    try:
        ds.get_many([60, 99])
        conn.send("read")
    except ShardError as e:
        conn.send(str(e))


def test_truncated_parquet_under_an_open_reader_is_an_error_not_sigbus(parquet_dataset, tmp_path):
    root = copy_dataset(parquet_dataset, tmp_path)
    path = os.path.join(root, "part-1.parquet")
    message = _in_child(_read_after_truncation, root, path)
    assert message.startswith(f"{path}: shard is 4096 bytes but the index records"), message
    assert "changed during the run (it shrank" in message


# -- the parts ---------------------------------------------------------------------------------
def _read_shrunk(conn: Any, reader_cls: Any, path: str, info: Any) -> None:
    with reader_cls(path, info) as reader:
        first = reader.read_rows([0, 1])[1]["data"]
        os.truncate(path, os.path.getsize(path) // 2)
        try:
            reader.read_rows([2])
            conn.send((first, "read"))
        except ShardChangedError as e:
            conn.send((first, str(e)))


@pytest.mark.parametrize("fixture_name,reader_cls", [
    ("arrow_dataset", ArrowShardReader), ("parquet_dataset", ParquetShardReader),
    ("tar_dataset", TarShardReader),
])
def test_open_reader_refuses_to_read_a_shrunk_file(request, fixture_name, reader_cls, tmp_path):
    fixture = request.getfixturevalue(fixture_name)
    root = copy_dataset(fixture, tmp_path)
    info = fixture.index.shards[0]
    path = os.path.join(root, info.path)
    size = os.path.getsize(path)
    first, message = _in_child(_read_shrunk, reader_cls, path, info)
    assert first == fixture.samples[1]["data"]
    assert message == f"{path}: shard changed while open (it shrank from {size} to {size // 2} bytes)"


def test_reader_opened_on_another_file_than_verified(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    info = arrow_dataset.index.shards[0]
    path = os.path.join(root, info.path)
    verified = path_identity(path)
    shutil.copyfile(path, path + ".new")
    os.replace(path + ".new", path)
    with pytest.raises(ShardChangedError, match=rf"{path}: shard changed after it was verified "
                                                r"\(it was replaced by another file\)"):
        open_shard(info, path, expect=verified)
    with open_shard(info, path, expect=path_identity(path)) as reader:
        assert reader.read(0)["name"] == arrow_dataset.samples[0]["name"]


def test_renamed_over_file_leaves_an_open_reader_on_its_verified_bytes(arrow_dataset, tmp_path):
    root = copy_dataset(arrow_dataset, tmp_path)
    info = arrow_dataset.index.shards[1]
    path = os.path.join(root, info.path)
    reader = open_shard(info, path)
    os.replace(os.path.join(root, "shard-00000.arrow"), path)
    assert reader.read(5)["data"] == arrow_dataset.samples[64 + 5]["data"]  # the pinned inode
    reader.close()


def test_identity_change_words(tmp_path):
    a = FileIdentity(1, 2, 100, 5, 7)
    assert a.change_to(FileIdentity(1, 3, 100, 5, 7)) == "it was replaced by another file"
    assert a.change_to(FileIdentity(1, 2, 40, 6, 8)) == "it shrank from 100 to 40 bytes"
    assert a.change_to(FileIdentity(1, 2, 140, 6, 8)) == "it grew from 100 to 140 bytes"
    assert a.change_to(FileIdentity(1, 2, 100, 6, 8)) == "it was modified in place"
    assert a.change_to(FileIdentity(1, 2, 100, 5, 8)).startswith(
        "its inode changed with its size and mtime kept (rewritten in place with its mtime put back")
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        guard = FileGuard(str(path), fd)
        guard.check()
        os.utime(path, ns=(0, guard.identity.mtime_ns + 1))
        with pytest.raises(ShardChangedError, match="modified in place"):
            guard.check()
    finally:
        os.close(fd)


def test_rewrite_in_place_with_mtime_put_back_is_verified_again(arrow_dataset, tmp_path, monkeypatch):
    """Issue 25 item 4: same size, same inode, mtime restored with os.utime; the inode change
    time moved, so the next read verifies the shard again and fails naming it. Opening it again
    while it is unchanged does not verify it again."""
    import shardloader.source.local as local

    verified: list[str] = []
    real_verify = local.verify_local_file

    def counting_verify(path: str, info: Any) -> Any:
        verified.append(os.path.basename(path))
        return real_verify(path, info)

    monkeypatch.setattr(local, "verify_local_file", counting_verify)
    root = copy_dataset(arrow_dataset, tmp_path)
    ds = Dataset(root, max_open_shards=1)  # every switch of shard closes and reopens a reader
    for i in (0, 70, 1, 71, 2):
        assert ds[i]["data"] == arrow_dataset.samples[i]["data"]
    assert verified == ["shard-00000.arrow", "shard-00001.arrow"]  # once each, reopens trusted
    path = os.path.join(root, "shard-00000.arrow")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-4096:-2048] = bytes(2048)  # other bytes, same size
    rewrite_keeping_mtime(path, bytes(data))
    checksum = arrow_dataset.index.shards[0].checksum
    with pytest.raises(ChecksumMismatch) as caught:  # the open reader notices, the reopen verifies
        ds.get_many(list(range(64)))
    assert str(caught.value).startswith(f"{path}: checksum ")
    assert f"does not match the index ({checksum}); the file changed during the run (its inode " \
           "changed with its size and mtime kept" in str(caught.value)
    assert verified[2:] == ["shard-00000.arrow"]
    ds.close()
