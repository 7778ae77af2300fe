"""Shuffle quality: how mixed a batch is on a class-sorted dataset, against the shards a rank
must keep resident for it (issue 13). Pure simulation of orders over an index; no data is read.

Dataset: 7680 samples of 10 classes, written class by class (the layout `shardloader convert`
produced from an image folder before it shuffled by default), cut into 1, 8 or 64 equal shards.
Also "convert shuffled": the same samples written in a seeded random order (convert's default
now). Per-rank batch 32; world sizes 1, 2, 8; 4 epochs.

Columns, per rank batch (averaged over ranks, batches and epochs):
- classes: distinct classes in the batch; `vs uniform` divides by the exact expectation for 32
  samples drawn uniformly without replacement (9.68 with 10 equal classes).
- global: the same ratio for the global batch (all ranks' batches of a step together, 32 x W),
  which is also what any world size sees in shardloader's order at world size 1.
- shards: distinct shards in the batch.
- resident: the shards a rank must keep at once to download each shard at most once per epoch
  (the most shards open at any step, a shard being open from its first to its last read by the
  rank), max over ranks and epochs: the cache a rank needs. The design budget of shardloader's
  order is ceil(partitions / W) * window shards per rank (16 / 8 / 2 by default).

Orders compared:
- shardloader: this library's `EpochOrder` (defaults: partitions 8, window 2).
- shardloader v1: the previous order (shards permuted, P contiguous partitions, windows of w
  consecutive shards), re-implemented here from its description for the comparison.
- uniform: a uniform random permutation of the epoch (numpy), ranks take p = r (mod W).
- torch randperm: torch's own `DistributedSampler` (randperm seeded by seed + epoch, rank r
  takes indices r::W), run here as the real torch class.
- streaming py1e* and litdata*: REFERENCE SIMULATIONS written for this benchmark from the
  published descriptions of mosaicml-streaming's py1e shuffle and litData's chunk shuffle, not
  their code (neither library is installed here). py1e: shard order fixed for the run and split
  into canonical nodes (1 here, one physical node); per epoch the shard pieces of a canonical
  node are permuted, samples of each piece are spread uniformly over a range of `block` samples
  around the piece, and sorted; rank r reads the r-th contiguous 1/W of the sequence. At its
  documented default block (4M samples) the range covers this whole dataset, a global shuffle;
  the `block=16 shards` row holds it to the resident budget of shardloader's defaults.
  litdata: chunks (shards) are permuted per epoch, split among ranks in contiguous runs by
  sample count, and each rank reads its chunks one after another with the samples of the
  current chunk shuffled (one worker per rank).

Run: .venv/bin/python -m benchmarks.mixing
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from benchmarks._common import table
from shardloader.order import EpochOrder, ShuffleSettings
from shardloader.order.keys import derive_key, derive_keys
from shardloader.order.permute import feistel_permute, keyed_permutation

SAMPLES, CLASSES, BATCH, EPOCHS, SEED = 7680, 10, 32, 4, 0
SHARDS, WORLDS = (1, 8, 64), (1, 2, 8)
PARTITIONS, WINDOW = 8, 2


# -- orders: each returns, per rank, the epoch's sample sequence ---------------------------
def shardloader_order(sizes: np.ndarray, world: int, epoch: int) -> list[np.ndarray]:
    order = EpochOrder(sizes, SEED, epoch, ShuffleSettings(partitions=PARTITIONS, window=WINDOW))
    sequence = order.samples_at(np.arange(order.num_samples))
    return [sequence[r::world] for r in range(world)]


def shardloader_v1_order(sizes: np.ndarray, world: int, epoch: int) -> list[np.ndarray]:
    """Order version 1 (before issue 13), for the comparison."""
    n, parts = int(sizes.sum()), PARTITIONS
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    slot_shard = keyed_permutation(sizes.size, derive_key(1, SEED, epoch))
    slot_start = np.concatenate([[0], np.cumsum(sizes[slot_shard])])
    k = np.arange(parts + 1)
    part_start = k * (n // parts) + np.minimum(k, n % parts)
    first_slot = np.searchsorted(slot_start, part_start[:-1], "right") - 1
    p = np.arange(n)
    kk = p % parts
    v = part_start[kk] + p // parts
    slot = np.searchsorted(slot_start, v, "right") - 1
    w = (slot - first_slot[kk]) // WINDOW
    lo_slot = first_slot[kk] + w * WINDOW
    lo = np.maximum(slot_start[lo_slot], part_start[kk])
    hi = np.minimum(slot_start[np.minimum(lo_slot + WINDOW, sizes.size)], part_start[kk + 1])
    keys = derive_keys(derive_key(2, SEED, epoch), kk * np.int64(1 << 32) + w)
    v2 = lo + feistel_permute(v - lo, hi - lo, keys)
    slot2 = np.searchsorted(slot_start, v2, "right") - 1
    sequence = offsets[slot_shard[slot2]] + v2 - slot_start[slot2]
    return [sequence[r::world] for r in range(world)]


def uniform_order(sizes: np.ndarray, world: int, epoch: int) -> list[np.ndarray]:
    sequence = np.random.default_rng([SEED, epoch]).permutation(int(sizes.sum()))
    return [sequence[r::world] for r in range(world)]


def torch_randperm_order(sizes: np.ndarray, world: int, epoch: int) -> list[np.ndarray]:
    data = range(int(sizes.sum()))
    out = []
    for rank in range(world):
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
        sampler.set_epoch(epoch)
        out.append(np.fromiter(iter(sampler), dtype=np.int64))
    return out


def _py1e(block: int):
    def order(sizes: np.ndarray, world: int, epoch: int) -> list[np.ndarray]:
        """Reference simulation of streaming's py1e (see module docstring), one canonical node."""
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        run = np.random.default_rng(SEED)
        shards = run.permutation(sizes.size)  # fixed for the run
        rng = np.random.default_rng(SEED + epoch)
        shards = shards[rng.permutation(sizes.size)]  # pieces of the one canonical node
        ids = np.concatenate([rng.permutation(np.arange(offsets[s], offsets[s + 1])) for s in shards])
        n = ids.size
        positions = np.arange(n, dtype=np.float64)
        start = 0
        for s in shards:
            size = int(sizes[s])
            width = int(rng.integers(int(0.75 * block), int(1.25 * block)))
            cutoff = max(0.0, (width - size) / 2)
            low, high = max(-cutoff, -start), min(cutoff, n - start - size)
            positions[start:start + size] += rng.uniform(low, high, size)
            start += size
        sequence = ids[np.argsort(positions, kind="stable")]
        bounds = np.linspace(0, n, world + 1).astype(np.int64)
        return [sequence[bounds[r]:bounds[r + 1]] for r in range(world)]

    return order


def litdata_order(sizes: np.ndarray, world: int, epoch: int) -> list[np.ndarray]:
    """Reference simulation of litData's chunk shuffle (see module docstring)."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    rng = np.random.RandomState(SEED + epoch)
    chunks = rng.permutation(sizes.size)
    flat = np.concatenate([np.arange(offsets[c], offsets[c + 1]) for c in chunks])
    chunk_of = np.concatenate([np.full(sizes[c], i) for i, c in enumerate(chunks)])
    bounds = np.linspace(0, flat.size, world + 1).astype(np.int64)
    out = []
    for r in range(world):
        mine, runs = flat[bounds[r]:bounds[r + 1]], chunk_of[bounds[r]:bounds[r + 1]]
        pieces = [rng.permutation(mine[runs == c]) for c in np.unique(runs)]  # chunk by chunk
        out.append(np.concatenate(pieces))
    return out


ORDERS = {
    "shardloader": shardloader_order,
    "shardloader v1": shardloader_v1_order,
    "uniform": uniform_order,
    "torch randperm": torch_randperm_order,
    "streaming py1e* (default block)": _py1e(4_000_000),
    "streaming py1e* (block=16 shards)": None,  # built per shard count below
    "litdata*": litdata_order,
}


# -- measures -------------------------------------------------------------------------------
def expected_uniform_classes(class_sizes: np.ndarray, batch: int) -> float:
    n = int(class_sizes.sum())
    absent = [np.prod([(n - c - i) / (n - i) for i in range(batch)]) for c in class_sizes]
    return float(len(class_sizes) - sum(absent))


def open_shards(shard_sequence: np.ndarray) -> int:
    """Most shards open at once in a read sequence (open: from a shard's first to last read)."""
    if shard_sequence.size == 0:
        return 0
    ids = np.unique(shard_sequence)
    first = np.array([np.argmax(shard_sequence == s) for s in ids])
    last = np.array([shard_sequence.size - 1 - np.argmax(shard_sequence[::-1] == s) for s in ids])
    events = np.zeros(shard_sequence.size + 1, dtype=np.int64)
    np.add.at(events, first, 1)
    np.add.at(events, last + 1, -1)
    return int(np.cumsum(events).max())


def measure(order, sizes: np.ndarray, world: int, label: np.ndarray) -> dict[str, float]:
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    classes, shards, global_classes, resident = [], [], [], 0
    for epoch in range(EPOCHS):
        ranks = order(sizes, world, epoch)
        steps = min(r.size for r in ranks) // BATCH
        for step in range(steps):
            batches = [r[step * BATCH:(step + 1) * BATCH] for r in ranks]
            for b in batches:
                classes.append(np.unique(label[b]).size)
                shards.append(np.unique(np.searchsorted(offsets, b, "right")).size)
            global_classes.append(np.unique(label[np.concatenate(batches)]).size)
        for r in ranks:
            resident = max(resident, open_shards(np.searchsorted(offsets, r, "right") - 1))
    return {"classes": float(np.mean(classes)), "shards": float(np.mean(shards)),
            "global": float(np.mean(global_classes)), "resident": resident}


def main() -> None:
    torch.manual_seed(0)
    sorted_label = np.arange(SAMPLES) * CLASSES // SAMPLES
    layouts = {"class-sorted": sorted_label,
               "convert shuffled": sorted_label[keyed_permutation(SAMPLES, 1234)]}
    rows, summary = [], {}
    for layout, label in layouts.items():
        uniform_batch = expected_uniform_classes(np.bincount(label), BATCH)
        for shards in SHARDS:
            sizes = np.full(shards, SAMPLES // shards, dtype=np.int64)
            for world in WORLDS:
                uniform_global = expected_uniform_classes(np.bincount(label), BATCH * world)
                for name, order in ORDERS.items():
                    if order is None:
                        order = _py1e(16 * SAMPLES // shards)
                    if layout != "class-sorted" and name not in ("shardloader", "uniform"):
                        continue  # a shuffled layout mixes under any order; two rows suffice
                    m = measure(order, sizes, world, label)
                    ratio = m["classes"] / uniform_batch
                    summary[(layout, name, shards, world)] = ratio
                    rows.append([layout, name, shards, world, round(m["classes"], 2), round(ratio, 3),
                                 round(m["global"] / uniform_global, 3), round(m["shards"], 1),
                                 m["resident"]])
    print(f"{SAMPLES} samples, {CLASSES} classes, batch {BATCH} per rank, {EPOCHS} epochs; "
          f"uniform expectation {expected_uniform_classes(np.bincount(sorted_label), BATCH):.2f} "
          "classes per batch. * = reference simulation, not the library's code.\n")
    print(table(["layout", "order", "shards", "world", "classes", "vs uniform", "global vs uniform",
                 "shards/batch", "resident"], rows))
    print("\nRatios (classes per rank batch / uniform), class-sorted, world size 1:")
    for name in ORDERS:
        cells = [f"{s} shards {summary[('class-sorted', name, s, 1)]:.3f}" for s in SHARDS]
        print(f"  {name:34s} " + ", ".join(cells))
    worst_default = min(summary[("convert shuffled", "shardloader", s, w)] for s in SHARDS for w in WORLDS)
    worst_kept = min(summary[("class-sorted", "shardloader", s, 1)] for s in SHARDS)
    print(f"\nshardloader, convert shuffled (default), worst over shards and world sizes: "
          f"{worst_default:.3f} of uniform (goal 0.97)")
    print(f"shardloader, source order kept, worst over shards at world size 1: {worst_kept:.3f} "
          "of uniform (goal 0.9)")
    for world in WORLDS[1:]:
        worst = min(summary[("class-sorted", "shardloader", s, world)] for s in SHARDS)
        print(f"  per rank batch at world size {world} (budget {-(-PARTITIONS // world) * WINDOW} shards "
              f"per rank): worst {worst:.3f} — bounded by the shards a rank holds; write shuffled")


if __name__ == "__main__":
    main()
