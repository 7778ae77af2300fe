"""`StepPlan`: which samples a rank reads at a step — the order module bound to one loader's
settings, small enough to send to worker processes — and the shards those steps read, in
order of need, for prefetch (`first_shards`, `shards_ahead`: pure order arithmetic, no I/O).

Workers compute their own batch's samples from (epoch, step), so the training thread pays
nothing for the order (about a millisecond per batch of Feistel rounds otherwise).

Memory. An epoch's `EpochOrder` holds O(shards) arrays (about 20 bytes per shard, plus the
plan's shard offsets, 8). Built in each process that asks for it, that is private memory in
every worker: at 10^6 shards, before the order's arrays were made smaller and shared, 135 MB
per worker (56 MB of arrays, the rest heap its temporaries left behind; `benchmarks/scale.py`).
So the training process builds the epoch's order before it forks workers (`EpochIterator`
asks `order(epoch)` first), and forked workers find it in the plan they inherit: its arrays'
pages are never written, so they stay shared copy-on-write. After building a large order the
C heap's freed pages are handed back (`trim_heap`), so that a forked worker's own allocations
do not write into, and copy, pages its parent's temporaries left. Persistent workers (for the
epochs after the one they were forked in), and workers started by "spawn" or "forkserver",
build their orders themselves, and keep one at a time: about 20 bytes per shard private each
(measured at 10^6 shards, persistent: 32 MB private per worker at epochs 1 and 2, 11 MB at
epoch 0; 191 and 239 MB before).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from shardloader.order.partition import (
    dropped_samples,
    padded_samples,
    step_counts,
    step_positions,
    steps_per_epoch,
)
from shardloader.order.shuffle import EpochOrder, ShuffleSettings, prefix_sums
from shardloader.runtime.heap import trim_heap

#: Steps whose samples are computed in one call. The order's Feistel rounds on one batch's
#: few dozen indices cost mostly numpy's per-call overhead: on this project's 2-core machine
#: `samples_at` took 0.69 ms for 64 positions, 0.97 ms for 1,024 (a block of 16 steps of 64)
#: and 1.58 ms for 4,096 (64 steps). Every worker computes the blocks of its steps, that is
#: each block, and uses 1/num_workers of it: with 2 workers, 1.9 us per sample it uses at 16
#: steps and 0.8 at 64 (of a worker's ~235 us per DecodeCropFlip(112) sample). Each sample's
#: index is computed independently of the others, so the block gives exactly the per-step
#: result.
BLOCK_STEPS = 64
#: Blocks kept: a prefetch thread and the training thread of one process read different ones.
_BLOCKS_KEPT = 4
#: Orders of at least this many pieces are followed by a heap trim (`order`): below it there is
#: little to give back (a trim costs about a millisecond).
_TRIM_PIECES = 1 << 16
#: `shards_ahead` skips a shard read again while it is among this many most recently read.
_RECENT_SHARDS = 256

Shard = TypeVar("Shard")


@dataclass
class StepPlan:
    shard_sizes: np.ndarray
    seed: int
    settings: ShuffleSettings
    rank: int
    world_size: int
    global_batch_size: int
    tail: str
    #: The prefix sums of `shard_sizes` (int64, S + 1), where the caller has them already (the
    #: index's `sample_offsets`): used instead of a copy made here. None: made when needed.
    offsets: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: A `PureSampler` (see `shardloader.loader.protocol`) whose `samples_at` replaces the
    #: Loader's own `EpochOrder`: its len() positions per epoch are cut into steps and ranks
    #: exactly as the own order's are. None: the own order.
    sampler: Any = None
    _cache: dict[int, EpochOrder] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # thread workers
    _blocks: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict, repr=False)
    #: The process that made the plan (the training process): it keeps two epochs' orders,
    #: any other process (a worker) one (see `order`).
    _pid: int = field(default_factory=os.getpid, repr=False)

    @property
    def num_samples(self) -> int:
        total = self.__dict__.get("_num_samples")
        if total is None:  # the shard sizes never change: summed once (numpy's sum is ~40 us)
            total = self.__dict__["_num_samples"] = int(self.shard_sizes.sum())
        return total

    #: Whether any step's samples can be computed ahead (prefetch reads along them) and in
    #: the workers: a pure function of (epoch, step).
    looks_ahead = True

    @property
    def length(self) -> int:
        """Positions per epoch: the dataset's samples, or the sampler's len()."""
        return self.num_samples if self.sampler is None else len(self.sampler)

    @property
    def shard_offsets(self) -> np.ndarray:
        """Prefix sums of the shard sizes (int64, S + 1): one array for every epoch's order,
        made once per process (before the fork, in the training process: shared)."""
        offsets = self.__dict__.get("_shard_offsets")
        if offsets is None:
            if self.offsets is None:
                offsets = prefix_sums(self.shard_sizes)
                offsets.flags.writeable = False
            else:
                offsets = np.asarray(self.offsets, dtype=np.int64)  # no copy when it is int64
                if (offsets.shape != (len(self.shard_sizes) + 1,)
                        or offsets[0] != 0 or offsets[-1] != self.num_samples):
                    raise ValueError("offsets must be the int64 prefix sums of shard_sizes, from 0 "
                                     f"(length {len(self.shard_sizes) + 1})")
            self.__dict__["_shard_offsets"] = offsets
        return offsets

    def order(self, epoch: int) -> EpochOrder:
        """The epoch's order. The training process keeps the last two epochs' (its prefetch
        reads across an epoch boundary); a worker keeps one, since its tasks come epoch after
        epoch, so that persistent workers hold one order of their own, not two (a late task of
        an abandoned epoch would build its order again: time, never a different order).

        Built here at most once per process and epoch; a forked worker uses the one its parent
        built before the fork (see the module doc)."""
        kept = 2 if os.getpid() == self._pid else 1
        with self._lock:
            order = self._cache.get(epoch)
            if order is None and self.sampler is not None:
                order = self._cache[epoch] = SamplerOrder(self.sampler, self.seed, epoch, self.shard_offsets)
                while len(self._cache) > kept:
                    self._cache.pop(next(iter(self._cache)))
            if order is None:
                order = EpochOrder(self.shard_sizes, self.seed, epoch, self.settings, self.shard_offsets)
                self._cache[epoch] = order
                while len(self._cache) > kept:
                    self._cache.pop(next(iter(self._cache)))
                if self.settings.shuffle and order.piece_start.size > _TRIM_PIECES:
                    trim_heap()  # the build's temporaries: see the module doc
            return order

    def positions(self, step: int, rank: int | None = None) -> np.ndarray:
        return step_positions(step, self.rank if rank is None else rank, self.world_size,
                              self.global_batch_size, self.length, self.tail)

    def counts(self, step: int) -> tuple[int, int]:
        """(samples, padded) this rank reads at `step`, without computing which."""
        return step_counts(step, self.rank, self.world_size, self.global_batch_size,
                           self.length, self.tail)

    @property
    def global_steps(self) -> int:
        """Global steps per epoch (the same on every rank)."""
        return steps_per_epoch(self.length, self.global_batch_size, self.tail)

    def rank_batches(self) -> int:
        """This rank's batches per epoch, len(loader) (with tail="partial" under world_size > 1,
        a rank that gets nothing of the last global batch has one less)."""
        steps = self.global_steps
        if steps and self.counts(steps - 1)[0] == 0:
            steps -= 1
        return steps

    def tail_report(self) -> dict[str, int]:
        """How many positions each epoch pads or drops to give every rank equal batches."""
        n, g = self.length, self.global_batch_size
        return {"padded": padded_samples(n, g, self.tail), "dropped": dropped_samples(n, g, self.tail)}

    def begin(self, epoch: int, first_step: int) -> None:
        """An iteration over `epoch` begins at `first_step` (nothing to do: a pure order)."""

    def draw(self, epoch: int, step: int, *, inline: bool) -> tuple[np.ndarray | None, int, int] | None:
        """What the epoch iterator submits for `step`: (samples, padded, size); samples None
        where the worker computes them (not `inline`). None would mean the epoch ended there
        (an order drawn from a user's sampler; this one knows its steps)."""
        size, padded = self.counts(step)
        return (self.samples(epoch, step) if inline and size else None), padded, size

    def samples(self, epoch: int, step: int, rank: int | None = None) -> np.ndarray:
        """Global sample indices this rank (or `rank`) reads at `step` of `epoch`."""
        if rank is not None and rank != self.rank:
            return self.order(epoch).samples_at(self.positions(step, rank))
        first = step - step % BLOCK_STEPS
        with self._lock:
            block = self._blocks.get((epoch, first))
        if block is None:
            positions = [self.positions(s) for s in range(first, first + BLOCK_STEPS)]
            merged = self.order(epoch).samples_at(np.concatenate(positions))
            block = np.split(merged, np.cumsum([p.size for p in positions])[:-1])
            with self._lock:
                self._blocks[(epoch, first)] = block
                while len(self._blocks) > _BLOCKS_KEPT:
                    self._blocks.pop(next(iter(self._blocks)))
        return block[step - first].copy()

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_cache"] = {}
        state["_blocks"] = {}
        state.pop("_shard_offsets", None)  # made again where it is needed
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class SamplerOrder:
    """A `PureSampler`'s epoch, shaped as the `EpochOrder` the rest of the plan reads."""

    def __init__(self, sampler: Any, seed: int, epoch: int, shard_offsets: np.ndarray) -> None:
        self.sampler, self.seed, self.epoch = sampler, seed, epoch
        self.shard_offsets = shard_offsets

    def samples_at(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(self.sampler.samples_at(self.seed, self.epoch, positions), dtype=np.int64)

    def shards_of(self, samples: np.ndarray) -> np.ndarray:
        """Shard id of each global sample index."""
        return np.searchsorted(self.shard_offsets, np.asarray(samples, dtype=np.int64), "right") - 1


def first_shards(plan: StepPlan, epoch: int, steps: range, shards: Sequence[Shard]) -> list[Shard]:
    """The entries of `shards` that `steps` of `epoch` read, each once, in order of first read
    (none where the order cannot be computed ahead: a user's sampler, drawn as it goes)."""
    if not plan.looks_ahead:
        return []
    order = plan.order(epoch)
    first: dict[int, None] = {}
    for step in steps:
        first.update(dict.fromkeys(order.shards_of(plan.samples(epoch, step)).tolist()))
    return [shards[shard] for shard in first]


def shards_ahead(plan: StepPlan, epoch: int, steps: range, shards: Sequence[Shard]) -> Iterator[Shard]:
    """The entries of `shards` that `steps` of `epoch` read, in order of need: a shard comes
    again when it is read again after more than `_RECENT_SHARDS` others (it may have been
    evicted meanwhile). Lazy: a prefetcher takes only as many as its window holds."""
    if not plan.looks_ahead:
        return
    recent: dict[int, None] = {}
    for step in steps:
        read = plan.order(epoch).shards_of(plan.samples(epoch, step))
        _, first = np.unique(read, return_index=True)
        for shard in read[np.sort(first)].tolist():
            if shard not in recent:
                yield shards[shard]
            recent.pop(shard, None)
            recent[shard] = None  # most recent last
            if len(recent) > _RECENT_SHARDS:
                recent.pop(next(iter(recent)))
