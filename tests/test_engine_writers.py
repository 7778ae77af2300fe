"""Shards written by Spark (`shardloader.spark.write_dataframe`, local[2,3]) and Ray Data
(`shardloader.ray.write_dataset`, a local instance of 2 CPUs), the real engines embedded.

Each engine makes two writes, once per module (starting an engine costs 20-80 s):

- local, source order kept: 400 rows in 4 partitions; the first attempt of partition 1 is
  SIGKILLed after its first shard (the engine retries the task);
- ``s3://`` (moto), `shuffle=True`: 7680 class-sorted rows in 4 partitions (each holds 2-3 of 10
  classes); the first attempt of partition 2 is SIGKILLed after its first shard's upload.

In every task, after every shard, a hook asks for the dataset's index and records the answer,
so the tests see what a reader saw while the write was under way. Then: every row is read back
exactly once, no file of the killed attempts is left, verify passes (remote too), the shuffled
write mixes as `write_shards(shuffle=True)` does (the mixing check of tests/test_order.py), and
both engines wrote the same index, byte for byte.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

import numpy as np
import pytest

from shardloader import Dataset
from shardloader.format.index import Index
from shardloader.ingest.verify import indexed_names, unindexed_files, verify_dataset
from tests.test_order import BATCH, _distinct_classes_per_batch, _uniform_distinct_classes

pytestmark = pytest.mark.slow
LOCAL_ROWS, MIX_ROWS, CLASSES, PARTITIONS = 400, 7680, 10, 4


def _local_rows() -> list[dict[str, Any]]:
    return [{"id": i, "label": i // 40, "data": bytes([i % 251]) * (1 + i % 7)} for i in range(LOCAL_ROWS)]


def _mix_rows() -> list[dict[str, Any]]:
    return [{"id": i, "label": i * CLASSES // MIX_ROWS, "data": i.to_bytes(4, "big")}
            for i in range(MIX_ROWS)]


def _task_hook(dest: str, storage_options: dict | None, marks: str, kill_partition: int):
    """on_shard for the tasks: record whether a reader finds a dataset at `dest` (a file in
    `marks` per shard and process), and SIGKILL the first attempt of `kill_partition` once its
    first shard is written (the rest of the partition, and its manifest, not yet).
    Self-contained (imports inside), as the engines pickle it by value."""

    def on_shard(shard):
        import os
        import signal

        from shardloader.source.index import load_index

        partition, number = (int(x) for x in shard.path.split(".")[0].split("-")[1:])
        try:
            load_index(dest, storage_options)
            seen = "dataset"
        except Exception as e:  # what a reader gets before the commit
            seen = type(e).__name__
        open(os.path.join(marks, f"seen-{partition}-{number}-{os.getpid()}-{seen}"), "w").close()
        if (partition, number) != (kill_partition, 0):
            return
        try:
            os.close(os.open(os.path.join(marks, "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # the retry
        os.kill(os.getpid(), signal.SIGKILL)

    return on_shard


def _writes(tmp: str, s3_server, write) -> dict[str, Any]:
    """The module's two writes through `write(rows, dest, **options)` (rows: "local" for
    `_local_rows()`, "mix" for `_mix_rows()`); what each left."""
    out: dict[str, Any] = {"seconds": {}}
    local, marks = os.path.join(tmp, "local"), os.path.join(tmp, "marks-local")
    os.makedirs(marks)
    os.makedirs(local)
    start = time.perf_counter()
    write("local", local, shard_samples=30, on_shard=_task_hook(local, None, marks, 1))
    out["seconds"]["local"] = time.perf_counter() - start
    out["local"], out["local_marks"] = local, sorted(os.listdir(marks))
    options = s3_server.storage_options()
    url, marks = f"s3://{s3_server.create_bucket()}/ds", os.path.join(tmp, "marks-s3")
    os.makedirs(marks)
    start = time.perf_counter()
    write("mix", url, shard_samples=240, shuffle=True, partitions=PARTITIONS, seed=5,
          storage_options=options, on_shard=_task_hook(url, options, marks, 2))
    out["seconds"]["s3 shuffled"] = time.perf_counter() - start
    out["s3"], out["s3_marks"], out["storage_options"] = url, sorted(os.listdir(marks)), options
    return out


@pytest.fixture(scope="module")
def spark_writes(tmp_path_factory, s3_server):
    pytest.importorskip("pyspark")
    if shutil.which("java") is None:
        pytest.skip("Spark needs a Java runtime (17+): apt install openjdk-17-jre-headless")
    from pyspark.sql import SparkSession

    from shardloader.spark import write_dataframe

    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the tasks run this interpreter
    spark = (SparkSession.builder.master("local[2,3]")  # 2 threads, 3 attempts per task
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    # The rows of _local_rows() / _mix_rows() made by Spark itself (spark.range splits the ids
    # into contiguous partitions, as Ray's from_items does): no Python worker to build them.
    columns = {
        "local": ("id DIV 40", "unhex(repeat(lpad(hex(id % 251), 2, '0'), CAST(1 + id % 7 AS INT)))"),
        "mix": (f"id * {CLASSES} DIV {MIX_ROWS}", "unhex(lpad(hex(id), 8, '0'))"),
    }

    def write(rows, dest, **options):
        label, data = columns[rows]
        df = spark.range(LOCAL_ROWS if rows == "local" else MIX_ROWS, numPartitions=PARTITIONS)
        df = df.selectExpr("id", f"CAST({label} AS BIGINT) AS label", f"{data} AS data")
        return write_dataframe(df, dest, **options)

    try:
        yield _writes(str(tmp_path_factory.mktemp("spark")), s3_server, write)
    finally:
        spark.stop()
        if saved is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = saved


@pytest.fixture(scope="module")
def ray_writes(tmp_path_factory, s3_server):
    pytest.importorskip("ray.data")
    import ray
    import ray.data

    from shardloader.ray import write_dataset

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             object_store_memory=200 << 20)
    ray.data.DataContext.get_current().enable_progress_bars = False

    def write(rows, dest, **options):
        items = _local_rows() if rows == "local" else _mix_rows()
        return write_dataset(ray.data.from_items(items, override_num_blocks=PARTITIONS), dest, **options)

    try:
        yield _writes(str(tmp_path_factory.mktemp("ray")), s3_server, write)
    finally:
        ray.shutdown()


@pytest.fixture(params=["spark", "ray"])
def writes(request):
    return request.getfixturevalue(f"{request.param}_writes")


def _rows_of(url: str, storage_options: dict | None = None, cache_dir: str | None = None):
    ds = Dataset(url, storage_options=storage_options, cache_dir=cache_dir)
    try:
        return ds.index, ds.get_many(range(len(ds)))
    finally:
        ds.close()


def test_every_row_is_read_back_once_after_a_task_killed_mid_write(writes):
    index, rows = _rows_of(writes["local"])
    # each row once, in source order: partitions are contiguous slices, indexed in id order
    assert [(r["id"], r["label"], r["data"]) for r in rows] == [
        (r["id"], r["label"], r["data"]) for r in _local_rows()]
    marks = writes["local_marks"]
    assert "killed" in marks
    first_shard = [m for m in marks if m.startswith("seen-1-0-")]
    assert len({m.split("-")[3] for m in first_shard}) == 2  # two processes: the attempt and its retry
    # no orphan, no duplicate: exactly the index's files
    assert sorted(os.listdir(writes["local"])) == sorted(indexed_names(index) | {"index.json"})
    assert verify_dataset(writes["local"]) == [] and unindexed_files(writes["local"]) == []


def test_no_reader_sees_a_dataset_before_the_commit(writes):
    for marks in (writes["local_marks"], writes["s3_marks"]):
        seen = {m.rsplit("-", 1)[1] for m in marks if m.startswith("seen-")}
        assert seen == {"DatasetIndexError"}


def test_shuffled_write_to_s3_reads_verifies_and_mixes(writes, tmp_path):
    index, rows = _rows_of(writes["s3"], writes["storage_options"], str(tmp_path / "cache"))
    assert sorted(r["id"] for r in rows) == list(range(MIX_ROWS))
    assert "killed" in writes["s3_marks"]
    assert len({m.split("-")[3] for m in writes["s3_marks"] if m.startswith("seen-2-0-")}) == 2
    assert verify_dataset(writes["s3"], writes["storage_options"]) == []
    assert unindexed_files(writes["s3"], writes["storage_options"]) == []
    # mixing: what tests/test_order.py and benchmarks/mixing.py ask of write_shards(shuffle=True),
    # >= 0.97 of a uniform shuffle's classes per rank batch at world sizes 1, 2 and 8; the same
    # shards holding the rows as the engine held them (class-sorted partitions) give 0.26 at 8
    label = np.array([r["label"] for r in rows])
    uniform = _uniform_distinct_classes(np.bincount(label), BATCH)
    ratios = [_distinct_classes_per_batch(index.shard_samples, label, world=w) / uniform
              for w in (1, 2, 8)]
    assert min(ratios) >= 0.97, ratios
    as_held = np.array([r["label"] for r in _mix_rows()])
    assert _distinct_classes_per_batch(index.shard_samples, as_held, world=8) / uniform < 0.5


def test_both_engines_write_the_same_index_byte_for_byte(spark_writes, ray_writes):
    import fsspec

    for key in ("local", "s3"):
        documents = []
        for run in (spark_writes, ray_writes):
            fs, path = fsspec.core.url_to_fs(run[key], **(run["storage_options"] if key == "s3" else {}))
            documents.append(fs.cat_file(f"{path}/index.json"))
        assert documents[0] == documents[1], key
        assert Index.loads(documents[0]).num_samples == (LOCAL_ROWS if key == "local" else MIX_ROWS)
    print("engine write seconds:", {"spark": spark_writes["seconds"], "ray": ray_writes["seconds"]})
