"""Which order a Loader reads, from DataLoader's `sampler=`, `batch_sampler=`, `shuffle=`,
`drop_last=` and `batch_size=` (with DataLoader's rules for combining them), and the order's
part of the Loader's state (key "sampler").

Five kinds (docs/samplers.md):

- "own": the Loader's own order (`shardloader.order.shuffle`), with `StepPlan`;
- "pure": a `PureSampler` (or the sampler of a dataset that `OrdersItself`): `StepPlan` with
  its `samples_at` in place of the own order, cut into global batches and ranks the same way;
- "pure-batches": a `PureBatchSampler`, with `BatchPlan` (each batch a global batch);
- "drawn" / "drawn-batches": any other sampler or batch sampler, drawn in the training
  process by `DrawnPlan` (this rank's: not split again), resumed from its state_dict() or by
  fast-forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from shardloader.loader.batch_plan import BatchPlan
from shardloader.loader.cursor import Cursor
from shardloader.loader.drawn import DrawnPlan, describe
from shardloader.loader.plan import StepPlan
from shardloader.loader.protocol import KeepsOrderState, OrdersItself, PureBatchSampler, PureSampler
from shardloader.loader.samplers import LoaderBatchSampler, LoaderSampler
from shardloader.order.partition import epoch_length


def check_sampler_arguments(*, batch_size: Any, shuffle: Any, sampler: Any, batch_sampler: Any,
                            drop_last: bool) -> None:
    """DataLoader's refusals (its ValueError and message first), with what to write instead."""
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle: a sampler= gives the "
                         "order itself (pass shuffle=False, or drop the sampler)")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, "
                             "sampler, and drop_last: the batch sampler gives each batch whole")
    elif batch_size is None and drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive "
                         "with drop_last")
    for name, value in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        if value is not None and not isinstance(value, (Iterable, PureSampler, PureBatchSampler)):
            raise TypeError(f"{name}= must be a torch Sampler or an iterable of "
                            f"{'indices' if name == 'sampler' else 'lists of indices'}, got "
                            f"{type(value).__name__}")


def choose_order(dataset: Any, *, shuffle: bool, sampler: Any, batch_sampler: Any) -> tuple[str, Any]:
    """(kind, the sampler or batch sampler or None) for a Loader's arguments (module doc)."""
    if batch_sampler is not None:
        return ("pure-batches" if isinstance(batch_sampler, PureBatchSampler) else "drawn-batches"), batch_sampler
    if sampler is None and isinstance(dataset, OrdersItself):
        sampler = dataset.epoch_sampler(bool(shuffle))
        if not isinstance(sampler, PureSampler):
            raise TypeError(f"{type(dataset).__qualname__}.epoch_sampler() must return a PureSampler "
                            f"(len, samples_at, fingerprint), got {type(sampler).__name__}")
        return "pure", sampler
    if sampler is None:
        return "own", None
    return ("pure" if isinstance(sampler, PureSampler) else "drawn"), sampler


def check_distributed(given: Any, rank: int, world_size: int) -> None:
    """A DistributedSampler (given, or inside a batch sampler) made for another rank or world
    size than the Loader's would read another rank's share: ValueError saying what to write."""
    inner = getattr(given, "sampler", None)  # a BatchSampler's sampler
    for candidate in (given, inner):
        if isinstance(candidate, DistributedSampler) and (
                (candidate.num_replicas, candidate.rank) != (world_size, rank)):
            raise ValueError(
                f"sampler: DistributedSampler(num_replicas={candidate.num_replicas}, "
                f"rank={candidate.rank}) disagrees with this Loader, rank {rank} of {world_size}: "
                f"write DistributedSampler(dataset, num_replicas={world_size}, rank={rank}), or drop "
                f"the sampler and pass shuffle=True (the Loader splits its own order across ranks)")


def order_fingerprint(kind: str, source: Any) -> str | None:
    """The order's identity in the Loader's fingerprint: None for the own order."""
    if kind == "own":
        return None
    if kind.startswith("pure"):
        identity = str(source.fingerprint)
    else:
        identity = describe(source)
    return f"batch_sampler {identity}" if kind.endswith("batches") else identity


def saved_order_state(kind: str, source: Any, plan: Any, cursor: Cursor) -> Any:
    """What the Loader's state keeps under "sampler": a pure sampler's `order_state`, a drawn
    sampler's state_dict() as of the last delivered batch; None when there is none."""
    if kind.startswith("pure") and isinstance(source, KeepsOrderState):
        return source.order_state(cursor.epoch, cursor.position)
    if isinstance(plan, DrawnPlan):
        return plan.saved_state(cursor.last_batch)
    return None


def load_order_state(kind: str, source: Any, plan: Any, state: Any, epoch: int, position: int,
                     step: int) -> None:
    """Hand the saved "sampler" entry back before a resume (see `saved_order_state`)."""
    if kind.startswith("pure") and isinstance(source, KeepsOrderState) and state is not None:
        source.load_order_state(state, epoch, position)
    if isinstance(plan, DrawnPlan):
        plan.restore(epoch, step, state)


def make_plan(kind: str, source: Any, *, data: Any, seed: int, settings: Any, rank: int,
              world_size: int, global_batch_size: int, tail: str, batch_size: int,
              drop_last: bool) -> Any:
    """The plan of `kind` (module doc): what the epoch iterator asks each step's samples of."""
    offsets = data.index.sample_offsets
    if kind in ("own", "pure"):
        return StepPlan(np.diff(offsets), seed, settings, rank, world_size, global_batch_size, tail,
                        offsets, sampler=source if kind == "pure" else None)
    if kind == "pure-batches":
        return BatchPlan(source, seed, rank, world_size, np.asarray(offsets, dtype=np.int64))
    return DrawnPlan(source, batch_size=None if kind == "drawn-batches" else batch_size,
                     drop_last=drop_last)


def make_cursor(kind: str, plan: Any, global_batch_size: int, tail: str) -> Cursor:
    """The cursor over `plan`'s epochs: global positions for samplers (a step consumes the
    global batch), batches for batch samplers."""
    if kind in ("own", "pure"):
        return Cursor(epoch_length(plan.length, global_batch_size, tail), global_batch_size)
    per_step = 1 if kind.endswith("batches") else global_batch_size
    return Cursor(plan.global_steps * per_step, per_step)


def order_views(kind: str, source: Any, loader: Any, batch_size: int | None, drop_last: bool) -> tuple[Any, Any]:
    """`loader.sampler` and `loader.batch_sampler`, as DataLoader sets them: the sampler given
    and a BatchSampler over it; the batch sampler given (and a SequentialSampler); the Loader's
    own order shaped as both (`LoaderSampler`); no batch sampler for `batch_size=None`."""
    if kind == "own":
        sampler = LoaderSampler(loader)
        return sampler, (None if batch_size is None else LoaderBatchSampler(loader, sampler))
    if kind.endswith("batches"):
        return SequentialSampler(range(loader.num_samples)), source
    return source, (None if batch_size is None else BatchSampler(source, batch_size, drop_last))
