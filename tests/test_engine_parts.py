"""The engine-neutral contract of distributed writes (`shardloader.ingest.parts`), driven here
by plain calls standing in for an engine's tasks and driver: names from the partition id, the
manifest as the task's commit, one index written by the driver in partition order, failed
attempts' files removed, and the keyed routing that shuffles across partitions.
(tests/test_engine_writers.py runs the same through Spark and Ray.)"""

from __future__ import annotations

import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from shardloader import Dataset
from shardloader.cli.main import main
from shardloader.errors import DatasetIndexError, SchemaError, ShardloaderError
from shardloader.ingest.parts import begin_write, commit_write, write_options, write_part
from shardloader.ingest.routing import ROUTE_FIELD, with_shuffle_keys
from shardloader.ingest.verify import unindexed_files, verify_dataset
from shardloader.ingest.writer import write_shards


def _rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"id": list(range(start, start + n)),
                     "data": [bytes([i % 251]) * (1 + i % 5) for i in range(start, start + n)]})


def _ids(path) -> list[int]:
    ds = Dataset(path)
    try:
        return [r["id"] for r in ds.get_many(range(len(ds)))]
    finally:
        ds.close()


def test_partitions_commit_into_one_index_in_partition_order(tmp_path):
    dest = str(tmp_path / "out")
    options = write_options(shard_samples=7)
    begin_write(dest)
    for partition in (2, 0, 1):  # tasks finish in any order
        write_part([_rows(20, 20 * partition)], dest, partition, options)
        assert not os.path.exists(os.path.join(dest, "index.json"))
        with pytest.raises(DatasetIndexError):
            Dataset(dest)  # no dataset until the driver commits
    index = commit_write(dest, partitions=[0, 1, 2])
    assert [s.path for s in index.shards][:4] == [
        "part-00000-00000.arrow", "part-00000-00001.arrow", "part-00000-00002.arrow",
        "part-00001-00000.arrow"]
    assert _ids(dest) == list(range(60))
    assert not os.path.exists(os.path.join(dest, "_parts"))
    assert verify_dataset(dest) == [] and unindexed_files(dest) == []


def _killed_while_a_shard_is_open(dest: str, options: dict) -> list[str]:
    """Partition 1's attempt in a child process SIGKILLed while its second shard is being
    written (its input stalls there: the kill comes when the writer asks for more rows);
    the files it left."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        def batches():
            yield _rows(8, 100).to_batches()[0]  # shard 0: 5 rows, whole; shard 1: 3 rows, open
            os.kill(os.getpid(), signal.SIGKILL)

        try:
            write_part(batches(), dest, 1, options)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return sorted(os.listdir(dest))


def test_a_retried_attempt_overwrites_and_failed_attempts_leave_nothing(tmp_path):
    dest = str(tmp_path / "out")
    options = write_options(shard_samples=5)
    begin_write(dest)
    left = _killed_while_a_shard_is_open(dest, options)
    assert [n for n in left if n.startswith(".part-00001-00001.arrow.tmp-")]  # the open shard
    assert "part-00001-00000.arrow" in left and "_parts" not in left  # no manifest
    # A second attempt that read more rows (its input changed) and died before its manifest:
    # part-00001-00000..00004.
    write_part([_rows(25, 100)], dest, 1, options)
    os.remove(os.path.join(dest, "_parts", "part-00001.json"))
    write_part([_rows(10, 0)], dest, 0, options)
    write_part([_rows(10, 10)], dest, 1, options)  # the retry
    index = commit_write(dest, partitions=[0, 1])
    assert _ids(dest) == list(range(20))
    names = {s.path for s in index.shards}
    leftover = [n for n in os.listdir(dest) if n != "index.json" and n.split(".ranges")[0] not in names]
    assert leftover == []
    assert verify_dataset(dest) == []


def test_a_straggler_after_the_commit_is_listed_by_verify(tmp_path, capsys):
    dest = str(tmp_path / "out")
    options = write_options(shard_samples=5)
    begin_write(dest)
    write_part([_rows(10)], dest, 0, options)
    commit_write(dest)
    write_part([_rows(5)], dest, 7, options)  # a zombie task of another job, after the commit
    assert verify_dataset(dest) == []  # the dataset still reads the same
    assert unindexed_files(dest) == sorted([
        f"{dest}/_parts/part-00007.json", f"{dest}/part-00007-00000.arrow",
        f"{dest}/part-00007-00000.arrow.ranges"])
    assert main(["verify", "-q", dest]) == 0  # listed, not a failure: readers never see them
    out = capsys.readouterr().out
    assert f"UNINDEXED  {dest}/part-00007-00000.arrow (not named by the index" in out
    assert out.count("UNINDEXED") == 3 and "ok: 2 shards, 10 samples" in out


def test_commit_refuses_files_that_differ_from_their_manifest(tmp_path):
    """Two live attempts of one partition that wrote different rows (speculation over a
    non-deterministic input): the last manifest does not describe the last shard files."""
    dest = str(tmp_path / "out")
    options = write_options(shard_samples=50)
    begin_write(dest)
    write_part([_rows(10)], dest, 0, options)
    manifest = open(os.path.join(dest, "_parts", "part-00000.json"), "rb").read()
    write_part([_rows(12)], dest, 0, options)
    with open(os.path.join(dest, "_parts", "part-00000.json"), "wb") as f:
        f.write(manifest)
    with pytest.raises(ShardloaderError, match=r"part-00000-00000.arrow: \d+ bytes, but its partition's manifest"):
        commit_write(dest)
    assert not os.path.exists(os.path.join(dest, "index.json"))
    write_part([_rows(10)], dest, 0, options)  # the shard agrees again; then its sidecar goes
    os.remove(os.path.join(dest, "part-00000-00000.arrow.ranges"))
    with pytest.raises(ShardloaderError, match=r"part-00000-00000.arrow.ranges: missing, but its partition's manifest"):
        commit_write(dest)


def test_bad_options_fail_on_the_driver():
    with pytest.raises(ValueError, match="partitions must be a positive integer or None, got 0"):
        write_options(shuffle=True, partitions=0)
    with pytest.raises(ValueError, match="format must be one of arrow, tar, got 'zip'"):
        write_options(format="zip")


def test_begin_refuses_a_dataset_and_clears_an_unfinished_write(tmp_path):
    dest = str(tmp_path / "out")
    write_shards([{"id": 1}], dest)
    with pytest.raises(ShardloaderError, match="index.json: the destination already holds a dataset"):
        begin_write(dest)
    begin_write(dest, overwrite=True)
    assert not os.path.exists(os.path.join(dest, "index.json"))
    write_part([_rows(3)], dest, 5, write_options())  # an aborted job's partition
    begin_write(dest)
    write_part([_rows(4)], dest, 0, write_options())
    assert commit_write(dest).num_samples == 4


def test_schemas_must_agree_and_empty_partitions_are_skipped(tmp_path):
    dest = str(tmp_path / "out")
    begin_write(dest)
    write_part([], dest, 0, write_options())
    write_part([_rows(3)], dest, 1, write_options())
    assert commit_write(dest).num_samples == 3
    other = str(tmp_path / "other")
    begin_write(other)
    write_part([_rows(3)], other, 0, write_options())
    write_part([pa.table({"id": ["a"], "data": [b"x"]})], other, 1, write_options())
    with pytest.raises(SchemaError, match="partitions 0 and 1 have different schemas"):
        commit_write(other)
    empty = str(tmp_path / "empty")
    begin_write(empty)
    write_part([], empty, 0, write_options())
    with pytest.raises(ShardloaderError, match="every partition is empty"):
        commit_write(empty)


def test_routing_depends_on_row_values_only(tmp_path):
    """The same rows in any partitioning and order get the same routes and digests, so the
    same output partitions hold the same rows in the same order."""
    table = _rows(500)
    whole = with_shuffle_keys(table.combine_chunks().to_batches()[0], 3, 4)
    shuffled = table.take(np.random.default_rng(0).permutation(500))
    pieces = [with_shuffle_keys(b, 3, 4) for b in shuffled.to_batches(max_chunksize=77)]
    key = lambda t: sorted(zip(t.column("id").to_pylist(), t.column(ROUTE_FIELD).to_pylist(),  # noqa: E731
                               t.column("__order__").to_pylist()))
    assert key(pa.Table.from_batches([whole])) == key(pa.Table.from_batches(pieces))
    counts = np.bincount(whole.column(ROUTE_FIELD).to_numpy(), minlength=4)
    assert counts.min() > 90  # about 125 each
    assert with_shuffle_keys(whole.select(["id", "data"]), 4, 4).column("__order__") != whole.column("__order__")
    # written through the contract: every partition holds its rows in digest order
    dest = str(tmp_path / "out")
    begin_write(dest)
    for p in range(4):
        part = pa.Table.from_batches(pieces).filter(pc.equal(pa.Table.from_batches(pieces).column(ROUTE_FIELD), p))
        write_part([part], dest, p, write_options(shard_samples=40, shuffle=True))
    index = commit_write(dest)
    assert sorted(_ids(dest)) == list(range(500)) and "__order__" not in index.schema
