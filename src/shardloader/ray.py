"""Writing a Ray Data Dataset as shards: `write_dataset(ds, dest)`.

Each Ray task writes its partition through the engine-neutral contract of
`shardloader.ingest.parts` (shards named after the partition id, then a manifest), and the
driver writes `index.json` once every task has committed. Ray is imported when a write starts
(install it with ``pip install 'shardloader[engines]'``).

Without `shuffle`, the Dataset is written through a Ray Data `Datasink`: write task i (Ray's
``task_idx``, one per block reaching the write) becomes partition i, its rows in their order,
and the sink's `on_write_complete` (on the driver, after every task) commits. With
`shuffle=True`, rows are moved to `partitions` output partitions by a keyed hash of their
values and written in that hash's order (`shardloader.ingest.routing`: each shard a uniform
sample, as `write_shards(shuffle=True)` gives), through Ray's own exchange
(`groupby(...).map_groups`), and the driver commits after the groups are written. A task whose
worker dies is retried by Ray (`max_retries`, default 3 here); its retry rewrites the same files.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa

from shardloader.format.index import Index, ShardInfo
from shardloader.ingest.parts import begin_write, commit_write, write_options, write_part
from shardloader.ingest.routing import ROUTE_FIELD, keyed_schema, with_shuffle_keys

_RETRIES = 3


def write_dataset(
    ds: Any,
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
    ray_remote_args: dict[str, Any] | None = None,
) -> Index:
    """Write Ray Dataset `ds` as shards plus `index.json` at `dest` (local path, or a URL every
    worker can write: ``s3://``, a shared mount); returns the index.

    Options as for `shardloader.write_shards`; `schema` (field -> type name) defaults to the
    Dataset's own types. `shuffle=True` (see the module doc) writes `partitions` output
    partitions (default: the blocks of `ds.materialize()`). `on_shard` runs in the task after
    each shard has appeared. `ray_remote_args` go to the writing tasks (``max_retries``
    defaults to 3). Refuses a `dest` that holds a dataset unless `overwrite`.
    """
    dest = os.fspath(dest)
    options = write_options(shard_bytes=shard_bytes, shard_samples=shard_samples, format=format,
                            schema=schema, storage_options=storage_options, shuffle=shuffle,
                            partitions=partitions)
    remote_args = {"max_retries": _RETRIES, **(ray_remote_args or {})}
    begin_write(dest, overwrite=overwrite, storage_options=storage_options)
    if not shuffle:
        sink = _sink_class()(dest, options, on_shard, storage_options, shard_table)
        ds.write_datasink(sink, ray_remote_args=remote_args)
        assert sink.index is not None  # on_write_complete ran, or write_datasink raised
        return sink.index
    if partitions is None:
        ds = ds.materialize()
        partitions = ds.num_blocks()
    keyed = ds.map_batches(functools.partial(_keyed, seed, partitions), batch_format="pyarrow")
    done = keyed.groupby(ROUTE_FIELD, num_partitions=partitions).map_groups(
        functools.partial(_write_group, dest, options, on_shard), batch_format="pyarrow",
        **remote_args)
    written = [row["partition"] for row in done.take_all()]
    return commit_write(dest, storage_options=storage_options, shard_table=shard_table,
                        partitions=written)


@functools.cache
def _sink_class() -> type:
    """The Datasink class, made on first use so that importing this module imports no Ray."""
    from ray.data import Datasink

    class ShardSink(Datasink):
        """Write task i writes partition i; the driver commits once all have written."""

        def __init__(self, dest: str, options: dict[str, Any], on_shard: Any,
                     storage_options: dict[str, Any] | None, shard_table: str) -> None:
            self.dest, self.options, self.on_shard = dest, options, on_shard
            self.storage_options, self.shard_table = storage_options, shard_table
            self.index: Index | None = None

        def write(self, blocks: Iterable[Any], ctx: Any) -> int:
            tables = (b if isinstance(b, pa.Table) else pa.Table.from_pandas(b, preserve_index=False)
                      for b in blocks)
            write_part(tables, self.dest, ctx.task_idx, self.options, self.on_shard)
            return ctx.task_idx

        def on_write_complete(self, write_result: Any) -> None:
            self.index = commit_write(self.dest, storage_options=self.storage_options,
                                      shard_table=self.shard_table,
                                      partitions=write_result.write_returns)

        @property
        def supports_distributed_writes(self) -> bool:
            return True

    return ShardSink


# -- in the tasks ----------------------------------------------------------------------------
def _keyed(seed: int, partitions: int, table: pa.Table) -> pa.Table:
    return pa.Table.from_batches([with_shuffle_keys(b, seed, partitions) for b in table.to_batches()],
                                 schema=keyed_schema(table.schema))


def _write_group(dest: str, options: dict[str, Any], on_shard: Any, table: pa.Table) -> pa.Table:
    partition = table.column(ROUTE_FIELD)[0].as_py()
    write_part([table], dest, partition, options, on_shard)
    return pa.table({"partition": [partition]})
