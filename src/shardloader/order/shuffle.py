"""The global sample order of an epoch: a pure function of sizes, seed, epoch and settings.

Order version 2: stratified lanes over a rotated index. With `P = partitions`, `w = window`
and `L = P * w` lanes:

1. **Rows.** Each shard's rows are permuted by a keyed Feistel permutation of (seed, epoch,
   shard): which rows of a shard travel together changes every epoch, independently of the
   epoch before. (A cheaper affine map, a * i + b mod size, was tried: in some pairs of epochs
   its maps nearly coincide, and a rank then sees mostly the same half of a shard twice.)
2. **Lanes.** The shards, in index (write) order and laid end to end, form a circle of N
   samples. It is rotated by a keyed offset of (seed, epoch) and cut into L lanes of equal
   size (±1 sample). A lane is a contiguous stretch of the index: a few whole shards, and
   pieces of shards at its ends.
3. **Pieces.** Inside a lane, its pieces (the parts of shards it holds) are visited in a keyed
   random order, except its two end pieces: a shard cut by a lane boundary has a piece in
   each lane, and both are read at the same time (both first or both last, alternating around
   the circle), so it is resident once rather than from the start to the end of the epoch.
4. **Partitions and windows.** Partition k owns the lanes k, k + P, ..., k + (w - 1) P, spread
   evenly around the circle. Its window u holds the u-th piece of each of its lanes; the samples
   of a window are permuted by a keyed Feistel permutation. Only a window's pieces (at most w
   shards) need to be resident for a partition at once.
5. **Interleave.** Global position p reads partition p mod P at offset p div P. Partition sizes
   differ by at most one, larger first, so every sample appears exactly once for every N, P.

Rank r of W takes positions p = r (mod W) (see `partition.py`). The sequence never mentions W,
so it is the same under any world size (I1); when W divides P, rank r reads only the lanes
= r (mod W), so each shard is downloaded by one rank (pieces at lane ends by two).

Why lanes and not the version-1 layout (shards permuted, cut into P contiguous partitions,
windows of w consecutive shards):

- **Mixing under a fixed resident budget.** A batch can only hold samples of the shards
  resident when it is drawn (P * w of them with one rank). When the index is sorted — an image
  folder written class by class, a log written by time — neighbouring shards hold alike samples,
  so the resident shards should be as far apart in the index as possible. The L lanes are L
  strata of the index, one resident piece each (a random one of its stratum): the batch is a
  stratified sample of the whole dataset. On class-sorted shards it holds 0.97-1.0 of a
  uniform shuffle's distinct classes (`benchmarks/mixing.py`; version 1, which held P random
  places of the index with w neighbouring shards each, reached 0.85); on shuffled shards it
  changes nothing. Evenly spaced places could coincide with a periodic layout (shard s holding
  class s mod L); a random place per stratum cannot.
- **Every rank sees every sample.** The rotation moves the lane boundaries every epoch, and the
  row permutation changes which rows of a shard share a lane, so a sample lands in a uniformly
  random lane, hence partition, hence rank, each epoch — as with torch's `DistributedSampler`.
  Version 1 cut a dataset of fewer shards than partitions at the same row ranges every epoch,
  so with W ranks each rank saw the same 1/W of the data forever.
- **One shard** (a small validation set, or a map-style dataset, which the order sees as one
  shard of len() samples) is resident whole; the row permutation makes its lanes random subsets,
  so its epoch is a uniform random permutation in effect.
- The unit of the shuffle stays the shard piece (not fixed-size blocks): blocks would multiply
  the resident shards by the number of blocks open at once, while pieces keep the budget at
  w shards per partition and cost O(shards + lanes) memory per epoch. The price: with W ranks
  a rank's own batch draws from ceil(P / W) * w shards, so at W = 8 a class-sorted dataset
  gives each rank's batch 2 shards' classes (the global batch still mixes). Shards written in
  a random order (`shardloader convert`'s default) mix under any W.

Nothing here does I/O or holds O(N) memory: an `EpochOrder` keeps O(shards + lanes) arrays and
maps any batch of positions to sample indices with two Feistel permutations and two binary
searches per position (about 5 microseconds per position, computed in the loader's workers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardloader.order.keys import (
    TAG_PIECES,
    TAG_ROTATE,
    TAG_ROWS,
    TAG_WINDOW,
    derive_key,
    derive_keys,
)
from shardloader.order.permute import feistel_permute

DEFAULT_PARTITIONS = 8
DEFAULT_WINDOW = 2
# The version of the algorithm above. Part of every fingerprint (ShuffleSettings.to_dict), so a
# loader state saved under another order version is refused instead of resumed into a different
# sequence. Bump it whenever samples_at can return something else for the same inputs.
ORDER_VERSION = 2
_LAST_KEY = (1 << 64) - 1


@dataclass(frozen=True)
class ShuffleSettings:
    """What besides the dataset and seed defines the order; all of it goes into fingerprints."""

    shuffle: bool = True
    partitions: int = DEFAULT_PARTITIONS
    window: int = DEFAULT_WINDOW  # lanes (so resident shards) per partition

    def __post_init__(self) -> None:
        if not isinstance(self.partitions, int) or self.partitions < 1:
            raise ValueError(f"partitions must be a positive integer, got {self.partitions!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be a positive integer, got {self.window!r}")

    @property
    def lanes(self) -> int:
        return self.partitions * self.window

    def to_dict(self) -> dict[str, object]:
        return {"shuffle": self.shuffle, "partitions": self.partitions, "window": self.window,
                "order": ORDER_VERSION}


def prefix_sums(counts: np.ndarray) -> np.ndarray:
    """int64 [0, c0, c0 + c1, ...] (length len(counts) + 1), made in one array."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, dtype=np.int64, out=out[1:])
    return out


def _even_cuts(n: int, parts: int) -> np.ndarray:
    """Start offsets of `parts` contiguous ranges of [0, n), sizes equal ±1, larger first."""
    k = np.arange(parts + 1, dtype=np.int64)
    return k * (n // parts) + np.minimum(k, n % parts)


def _compact(values: np.ndarray, bound: int) -> np.ndarray:
    """`values` (all in [0, bound)) as int32 where that holds them, else int64: the arrays an
    order keeps per piece cost 4 bytes instead of 8 in every process that builds one."""
    return values.astype(np.int32 if bound < 2**31 else np.int64, copy=False)


class EpochOrder:
    """The sample order of one epoch. `samples_at(positions)` is the whole API.

    `shard_sizes` are the per-shard sample counts from the index (shard order = write order);
    `shard_offsets`, when given, their prefix sums (length S + 1, from 0): a plan passes the
    one array it keeps for all epochs instead of a new one per order.

    Memory: what is kept is 16 bytes per piece (pieces <= shards + lanes: a shard and a row as
    int32 where they fit, a layout start as int64) and 8 bytes per window, besides the sizes
    and offsets it is given. Building it costs a few more O(pieces) temporaries, dropped before
    it returns. A forked worker that finds the order built by its parent shares all of it.
    """

    def __init__(self, shard_sizes: np.ndarray, seed: int, epoch: int, settings: ShuffleSettings,
                 shard_offsets: np.ndarray | None = None):
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        if sizes.ndim != 1 or (sizes.size and sizes.min() < 0):
            raise ValueError("shard_sizes must be a 1-D array of non-negative counts")
        self.settings = settings
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shard_sizes = sizes
        if shard_offsets is None:
            shard_offsets = prefix_sums(sizes)
        elif shard_offsets.shape != (sizes.size + 1,) or shard_offsets.dtype != np.int64:
            raise ValueError("shard_offsets must be the int64 prefix sums of shard_sizes (length S + 1)")
        self.shard_offsets = shard_offsets
        self.num_samples = int(shard_offsets[-1])
        if not settings.shuffle:
            return
        n, parts = self.num_samples, settings.partitions
        self.partition_start = _even_cuts(n, parts)
        self.row_key = derive_key(TAG_ROWS, self.seed, self.epoch)
        self.window_key = derive_key(TAG_WINDOW, self.seed, self.epoch)
        if n == 0:
            self._set_layout(*(np.zeros(0, dtype=np.int64),) * 4)
            return
        self._set_layout(*self._pieces(sizes, n))

    def _pieces(self, sizes: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(shard, row start, length, window id) of every piece, in layout order (steps 2-4 of
        the module doc). Temporaries are dropped as soon as they are used: the peak stays a few
        O(pieces) arrays (pieces <= shards + lanes)."""
        parts, lanes = self.settings.partitions, self.settings.lanes
        nonempty = np.flatnonzero(sizes > 0)
        # 2. The circle (index order) rotated by rho; lanes are equal cuts of the rotated circle.
        rho = derive_key(TAG_ROTATE, self.seed, self.epoch) % n if nonempty.size > 1 else 0
        lane_start = _even_cuts(n, lanes)
        cuts = np.concatenate([lane_start[:-1], (self.shard_offsets[nonempty] - rho) % n])
        del nonempty
        cuts.sort()
        lengths = np.diff(np.append(cuts, n))  # repeated cuts give empty pieces, dropped next
        keep = lengths > 0
        cuts, lengths = cuts[keep], lengths[keep]
        del keep
        lane = _compact(np.searchsorted(lane_start, cuts, "right") - 1, lanes)
        cuts += rho
        cuts %= n  # now the base (index order) position of each piece's first sample
        shard = _compact(np.searchsorted(self.shard_offsets, cuts, "right") - 1, sizes.size)
        cuts -= self.shard_offsets[shard]  # now the offset into the shard's permuted rows
        row_start = _compact(cuts, int(sizes.max()))
        del cuts
        # 3. Pieces of a lane in a keyed random order: u = rank of the piece within its lane,
        # except the lane's end pieces, which may be parts of shards cut by a lane boundary.
        # Lanes of several pieces alternate around the circle: one reads its first piece first
        # and its last piece last, the next the other way round (lanes of one piece do not
        # count), so the parts of a cut shard are read at the same time in both lanes (both at
        # the start, or both at the end of the epoch): resident once, not all epoch.
        piece_keys = derive_keys(derive_key(TAG_PIECES, self.seed, self.epoch), np.arange(lane.size))
        piece_keys >>= np.uint64(1)
        piece_keys += np.uint64(1)  # interior pieces: keys in [1, 2**63]
        multi = np.bincount(lane, minlength=lanes) > 1
        odd = ((np.cumsum(multi) - multi) & 1).astype(bool)[lane]
        first, last = np.uint64(0), np.uint64(_LAST_KEY)
        tail = np.ones(lane.size, dtype=bool)
        tail[:-1] = lane[1:] != lane[:-1]
        piece_keys[tail] = np.where(odd[tail], first, last)
        del tail
        head = np.ones(lane.size, dtype=bool)
        head[1:] = lane[1:] != lane[:-1]
        piece_keys[head] = np.where(odd[head], last, first)  # a lane of one piece: either way
        del head, odd
        order = np.lexsort((piece_keys, lane))
        del piece_keys
        in_order = lane[order]
        u = np.empty(lane.size, dtype=np.int64)
        u[order] = np.arange(lane.size) - np.searchsorted(in_order, in_order, "left")
        del order, in_order
        # 4. Layout: partition-major, then window u, then the lane's place i in the partition.
        order = np.lexsort((lane // parts, u, lane % parts))
        window_id = (lane % parts)[order] * np.int64(1 << 32) + u[order]
        del u, lane
        return shard[order], row_start[order], lengths[order], window_id

    def _set_layout(self, shard: np.ndarray, row_start: np.ndarray, length: np.ndarray,
                    window_id: np.ndarray) -> None:
        self.piece_shard = shard
        self.piece_row = row_start
        self.piece_start = prefix_sums(length)
        # Windows are runs of equal window_id in the layout. They are kept as their layout
        # starts alone: partition k's windows are u = 0, 1, ... in a row (a lane's pieces are
        # ranked from 0 without gaps), so window j's id is k << 32 | (j - first window of k).
        new = np.ones(window_id.size, dtype=bool)
        new[1:] = window_id[1:] != window_id[:-1]
        self.window_start = np.append(self.piece_start[:-1][new], self.piece_start[-1])
        window_partition = window_id[new] >> np.int64(32)
        self.partition_window = np.searchsorted(window_partition, np.arange(self.settings.partitions + 1))

    def nbytes(self) -> int:
        """Bytes of the arrays this order made (its pieces and windows; not the sizes and
        offsets it was given)."""
        if not self.settings.shuffle:
            return 0
        return sum(a.nbytes for a in (self.partition_start, self.piece_shard, self.piece_row,
                                      self.piece_start, self.window_start, self.partition_window))

    def layout_samples(self, virtual: np.ndarray) -> np.ndarray:
        """Sample at each layout position (the partitions laid end to end, before the window
        permutation): partition k holds layout positions [partition_start[k], ..[k+1])."""
        v = np.asarray(virtual, dtype=np.int64)
        piece = np.searchsorted(self.piece_start, v, "right") - 1
        shard = self.piece_shard[piece]
        offset = self.piece_row[piece] + (v - self.piece_start[piece])
        keys = derive_keys(self.row_key, shard)
        return self.shard_offsets[shard] + feistel_permute(offset, self.shard_sizes[shard], keys)

    def samples_at(self, positions: np.ndarray) -> np.ndarray:
        """Global sample indices at epoch positions `positions` (each in [0, N))."""
        p = np.asarray(positions, dtype=np.int64)
        n = self.num_samples
        if p.size and (p.min() < 0 or p.max() >= n):
            raise IndexError(f"positions must lie in [0, {n})")
        if not self.settings.shuffle or p.size == 0:
            return p.copy()
        parts = self.settings.partitions
        partition = p % parts
        v = self.partition_start[partition] + p // parts
        window = np.searchsorted(self.window_start, v, "right") - 1
        lo, hi = self.window_start[window], self.window_start[window + 1]
        # The window's id, partition << 32 | u (see _set_layout): v lies in its partition's windows.
        ids = (partition << np.int64(32)) + (window - self.partition_window[partition])
        keys = derive_keys(self.window_key, ids)
        return self.layout_samples(lo + feistel_permute(v - lo, hi - lo, keys))

    def shards_of(self, samples: np.ndarray) -> np.ndarray:
        """Shard id of each global sample index."""
        return np.searchsorted(self.shard_offsets, np.asarray(samples, dtype=np.int64), "right") - 1
