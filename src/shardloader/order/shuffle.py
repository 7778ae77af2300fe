"""The global sample order of an epoch: a pure function of sizes, seed, epoch and settings.

Two-level, shard-aware shuffle with canonical partitions (design.md, "Order"):

1. Shards are permuted by (seed, epoch) and laid end to end: a virtual sequence of N samples.
2. The virtual sequence is cut into `partitions` contiguous ranges of equal size (±1 sample).
   Partition k therefore holds about S/partitions shards (pieces of shards at its edges).
3. Within a partition, consecutive pieces are grouped into windows of `window` pieces; the
   samples of a window are permuted by a keyed Feistel permutation. Only a window's shards need
   to be resident at once.
4. Global position p reads partition p mod P at local offset p div P: the partitions' streams
   interleave round-robin. Partition sizes differ by at most one, and the larger ones come
   first, so this covers every sample exactly once for every N and P.

Rank r of W takes positions p = r (mod W) (see `partition.py`). Because the sequence never
mentions W, it is the same under any world size (I1), and when W divides P (or P divides W)
each rank reads only its own partitions' shards (download locality).

Nothing here does I/O or holds O(N) memory: an `EpochOrder` keeps O(shards + partitions)
arrays and maps any batch of positions to sample indices in O(1) per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardloader.order.keys import TAG_SHARDS, TAG_WINDOW, derive_key, derive_keys
from shardloader.order.permute import feistel_permute, keyed_permutation

DEFAULT_PARTITIONS = 8
DEFAULT_WINDOW = 2


@dataclass(frozen=True)
class ShuffleSettings:
    """What besides the dataset and seed defines the order; all of it goes into fingerprints."""

    shuffle: bool = True
    partitions: int = DEFAULT_PARTITIONS
    window: int = DEFAULT_WINDOW  # shards (pieces) per shuffle window, per partition

    def __post_init__(self) -> None:
        if not isinstance(self.partitions, int) or self.partitions < 1:
            raise ValueError(f"partitions must be a positive integer, got {self.partitions!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be a positive integer, got {self.window!r}")

    def to_dict(self) -> dict[str, object]:
        return {"shuffle": self.shuffle, "partitions": self.partitions, "window": self.window}


def resident_shards_per_rank(settings: ShuffleSettings, world_size: int) -> int:
    """How many shards one rank reads from at once (its partitions' current windows)."""
    if not settings.shuffle:
        return 2
    partitions_per_rank = -(-settings.partitions // world_size)
    return partitions_per_rank * settings.window


class EpochOrder:
    """The sample order of one epoch. `samples_at(positions)` is the whole API.

    `shard_sizes` are the per-shard sample counts from the index (shard order = write order).
    """

    def __init__(self, shard_sizes: np.ndarray, seed: int, epoch: int, settings: ShuffleSettings):
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        if sizes.ndim != 1 or (sizes.size and sizes.min() < 0):
            raise ValueError("shard_sizes must be a 1-D array of non-negative counts")
        self.settings = settings
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.num_samples = int(sizes.sum())
        self.shard_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        if not settings.shuffle:
            return
        nonempty = np.flatnonzero(sizes > 0)
        shard_key = derive_key(TAG_SHARDS, self.seed, self.epoch)
        # The slot order: which shard sits at each place of the virtual sequence.
        self.slot_shard = nonempty[keyed_permutation(nonempty.size, shard_key)]
        self.slot_start = np.concatenate([[0], np.cumsum(sizes[self.slot_shard])]).astype(np.int64)
        n, p = self.num_samples, settings.partitions
        k = np.arange(p + 1, dtype=np.int64)
        self.partition_start = k * (n // p) + np.minimum(k, n % p)
        # First slot of each partition (the slot holding its first sample).
        self.partition_first_slot = np.searchsorted(self.slot_start, self.partition_start[:-1], "right") - 1
        self.window_key = derive_key(TAG_WINDOW, self.seed, self.epoch)

    def samples_at(self, positions: np.ndarray) -> np.ndarray:
        """Global sample indices at epoch positions `positions` (each in [0, N))."""
        p = np.asarray(positions, dtype=np.int64)
        n = self.num_samples
        if p.size and (p.min() < 0 or p.max() >= n):
            raise IndexError(f"positions must lie in [0, {n})")
        if not self.settings.shuffle or p.size == 0:
            return p.copy()
        parts = self.settings.partitions
        window = self.settings.window
        k = p % parts
        v = self.partition_start[k] + p // parts  # virtual position before the window shuffle
        slot = np.searchsorted(self.slot_start, v, "right") - 1
        first = self.partition_first_slot[k]
        w = (slot - first) // window
        lo_slot = first + w * window
        hi_slot = lo_slot + window
        lo = np.maximum(self.slot_start[lo_slot], self.partition_start[k])
        hi = np.minimum(self.slot_start[np.minimum(hi_slot, self.slot_shard.size)], self.partition_start[k + 1])
        keys = derive_keys(self.window_key, k * np.int64(1 << 32) + w)
        v2 = lo + feistel_permute(v - lo, hi - lo, keys)
        slot2 = np.searchsorted(self.slot_start, v2, "right") - 1
        shard = self.slot_shard[slot2]
        return self.shard_offsets[shard] + (v2 - self.slot_start[slot2])

    def shards_of(self, samples: np.ndarray) -> np.ndarray:
        """Shard id of each global sample index."""
        return np.searchsorted(self.shard_offsets, np.asarray(samples, dtype=np.int64), "right") - 1
