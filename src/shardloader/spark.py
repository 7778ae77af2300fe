"""Writing a Spark DataFrame as shards: `write_dataframe(df, dest)`.

Each Spark task writes its partition through the engine-neutral contract of
`shardloader.ingest.parts` (shards named after the partition id, then a manifest), and the
driver writes `index.json` once every task has committed. pyspark is imported by Spark's own
objects only: this module needs none of it until `write_dataframe` is given a DataFrame
(install it with ``pip install 'shardloader[engines]'``; Spark needs a Java runtime, 17 or
later: ``apt install openjdk-17-jre-headless``).

Without `shuffle`, partition p of the DataFrame becomes ``part-<p>-*`` in its row order
(`mapInArrow`: one task per partition). With `shuffle=True`, rows are moved to `partitions`
output partitions by a keyed hash of their values and written in that hash's order
(`shardloader.ingest.routing`: each shard a uniform sample, as `write_shards(shuffle=True)`
gives), through Spark's own exchange (`groupBy(...).applyInArrow`). A task that fails is
retried by Spark (`spark.task.maxFailures`); its retry rewrites the same files.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from shardloader.format.index import Index, ShardInfo
from shardloader.ingest.parts import begin_write, commit_write, write_options, write_part
from shardloader.ingest.routing import ROUTE_FIELD, with_shuffle_keys

_RESULT = "partition long"


def write_dataframe(
    df: Any,
    dest: str | os.PathLike[str],
    *,
    shard_bytes: int = 256 << 20,
    shard_samples: int | None = None,
    format: str = "arrow",
    schema: dict[str, str] | None = None,
    shuffle: bool = False,
    seed: int = 0,
    partitions: int | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    shard_table: str = "auto",
    on_shard: Callable[[ShardInfo], None] | None = None,
) -> Index:
    """Write DataFrame `df` as shards plus `index.json` at `dest` (local path, or a URL every
    executor can write: ``s3://``, ``dbfs:/``, a shared mount); returns the index.

    Options as for `shardloader.write_shards`; `schema` (field -> type name) defaults to the
    DataFrame's own types. `shuffle=True` (see the module doc) writes `partitions` output
    partitions (default: the DataFrame's partition count). `on_shard` runs in the task after
    each shard has appeared (it must pickle). Refuses a `dest` that holds a dataset unless
    `overwrite`.
    """
    dest = os.fspath(dest)
    options = write_options(shard_bytes=shard_bytes, shard_samples=shard_samples, format=format,
                            schema=schema, storage_options=storage_options, shuffle=shuffle,
                            partitions=partitions)
    begin_write(dest, overwrite=overwrite, storage_options=storage_options)
    if shuffle:
        from pyspark.sql.types import BinaryType, LongType, StructField, StructType

        from shardloader.ingest.routing import ORDER_FIELD

        count = partitions or df.rdd.getNumPartitions()
        keyed_schema = StructType([*df.schema.fields, StructField(ROUTE_FIELD, LongType(), False),
                                   StructField(ORDER_FIELD, BinaryType(), False)])
        keyed = df.mapInArrow(functools.partial(_keyed, seed, count), keyed_schema)
        done = keyed.groupBy(ROUTE_FIELD).applyInArrow(_group_writer(dest, options, on_shard), _RESULT)
    else:
        done = df.mapInArrow(functools.partial(_write_partition, dest, options, on_shard), _RESULT)
    written = [row[0] for row in done.collect()]
    return commit_write(dest, storage_options=storage_options, shard_table=shard_table,
                        partitions=written)


# -- in the tasks ----------------------------------------------------------------------------
def _keyed(seed: int, partitions: int, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        yield with_shuffle_keys(batch, seed, partitions)


def _write_partition(dest: str, options: dict[str, Any], on_shard: Any,
                     batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    from pyspark import TaskContext

    partition = TaskContext.get().partitionId()
    write_part(batches, dest, partition, options, on_shard)
    yield pa.RecordBatch.from_pydict({"partition": [partition]})


def _group_writer(dest: str, options: dict[str, Any], on_shard: Any) -> Callable[[pa.Table], pa.Table]:
    """The function writing one output partition (a group); annotated, as pyspark's
    applyInArrow reads the annotations to tell a table function from an iterator one."""

    def write_group(table: pa.Table) -> pa.Table:
        partition = table.column(ROUTE_FIELD)[0].as_py()
        write_part([table], dest, partition, options, on_shard)
        return pa.table({"partition": [partition]})

    return write_group
