"""The order module is pure: these tests prove I1 (order depends only on sizes, seed, epoch and
settings), I2 (every sample exactly once; ranks disjoint, union = epoch) and download locality,
exhaustively on small cases and by simulation for world sizes 1..1024 and 10^8 samples."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardloader.order import (
    ORDER_VERSION,
    EpochOrder,
    ShuffleSettings,
    epoch_length,
    padded_samples,
    step_counts,
    step_positions,
    steps_per_epoch,
)
from shardloader.order.permute import feistel_permute, keyed_permutation


def _sequence(sizes, seed=0, epoch=0, **kw) -> np.ndarray:
    order = EpochOrder(np.asarray(sizes), seed, epoch, ShuffleSettings(**kw))
    return order.samples_at(np.arange(order.num_samples))


def _partition_of_samples(order: EpochOrder) -> np.ndarray:
    """For every sample, the partition its layout position (before the window shuffle) lies in."""
    n = order.num_samples
    virtual = np.arange(n)
    sample = order.layout_samples(virtual)
    partition = np.searchsorted(order.partition_start, virtual, "right") - 1
    out = np.empty(n, dtype=np.int64)
    out[sample] = partition
    return out


# -- permutations ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 15, 16, 17, 255, 256, 257, 1000, 65537])
def test_feistel_is_a_bijection(n):
    image = feistel_permute(np.arange(n), n, np.uint64(0xDEADBEEF))
    assert np.array_equal(np.sort(image), np.arange(n))


def test_feistel_is_pure_per_element():
    n = 10_007
    whole = feistel_permute(np.arange(n), n, np.uint64(7))
    pieces = np.concatenate([feistel_permute(np.arange(a, min(a + 333, n)), n, np.uint64(7))
                             for a in range(0, n, 333)])
    assert np.array_equal(whole, pieces)
    assert not np.array_equal(whole, feistel_permute(np.arange(n), n, np.uint64(8)))
    assert not np.array_equal(whole, np.arange(n))


def test_feistel_rejects_out_of_range():
    with pytest.raises(ValueError):
        feistel_permute(np.array([5]), 5, np.uint64(1))


def test_keyed_permutation_is_a_pure_permutation():
    a = keyed_permutation(1000, 42)
    assert np.array_equal(np.sort(a), np.arange(1000))
    assert np.array_equal(a, keyed_permutation(1000, 42))
    assert not np.array_equal(a, keyed_permutation(1000, 43))


def test_pinned_values_do_not_drift():
    """Orders must survive library upgrades: pin a few values of the pure functions.

    A deliberate change of the algorithm changes these values *and* ORDER_VERSION (which every
    loader fingerprint carries, so states saved under the old order are refused)."""
    assert ORDER_VERSION == 2
    order = EpochOrder(np.array([5, 0, 7, 3, 10]), 1, 2, ShuffleSettings(partitions=2, window=1))
    assert order.samples_at(np.arange(25)).tolist() == PINNED_SEQUENCE


# Order version 2 (stratified lanes over a rotated index).
PINNED_SEQUENCE = [18, 19, 21, 22, 24, 15, 23, 17, 20, 13, 16, 12, 3, 14, 4, 6, 1, 11, 2, 5, 0, 8, 7, 9, 10]


# -- exactly once ---------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    seed=st.integers(0, 2**63),
    epoch=st.integers(0, 1000),
    partitions=st.integers(1, 40),
    window=st.integers(1, 6),
)
def test_every_sample_exactly_once(sizes, seed, epoch, partitions, window):
    seq = _sequence(sizes, seed, epoch, partitions=partitions, window=window)
    assert np.array_equal(np.sort(seq), np.arange(sum(sizes)))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=20),
    seed=st.integers(0, 1000),
    partitions=st.integers(1, 16),
    window=st.integers(1, 4),
)
def test_window_shuffle_stays_inside_its_partition(sizes, seed, partitions, window):
    order = EpochOrder(np.asarray(sizes), seed, 0, ShuffleSettings(partitions=partitions, window=window))
    seq = order.samples_at(np.arange(order.num_samples))
    partition_of = _partition_of_samples(order)
    assert np.array_equal(partition_of[seq], np.arange(order.num_samples) % partitions)


def test_no_shuffle_is_index_order():
    seq = _sequence([3, 4, 5], shuffle=False)
    assert seq.tolist() == list(range(12))


def test_order_depends_on_seed_and_epoch_only():
    sizes = [100] * 20
    base = _sequence(sizes, seed=1, epoch=0)
    assert np.array_equal(base, _sequence(sizes, seed=1, epoch=0))
    assert not np.array_equal(base, _sequence(sizes, seed=1, epoch=1))
    assert not np.array_equal(base, _sequence(sizes, seed=2, epoch=0))
    # Positions computed in any grouping give the same samples.
    order = EpochOrder(np.asarray(sizes), 1, 0, ShuffleSettings())
    rng = np.random.default_rng(0)
    probe = rng.integers(0, 2000, 300)
    assert np.array_equal(order.samples_at(probe), base[probe])


def test_shuffle_mixes_shards_within_a_batch():
    sizes = [1000] * 64
    order = EpochOrder(np.asarray(sizes), 0, 0, ShuffleSettings(partitions=8, window=2))
    first_batch = order.samples_at(np.arange(64))
    shards = set(order.shards_of(first_batch).tolist())
    assert len(shards) >= 8  # one per partition at least
    # and the sequence is not a run of consecutive indices
    assert np.count_nonzero(np.diff(first_batch) == 1) < 8


# -- steps, ranks and the tail --------------------------------------------------------------
@pytest.mark.parametrize("tail", ["pad", "drop", "partial"])
@pytest.mark.parametrize("n,global_batch", [(0, 4), (1, 4), (10, 4), (12, 4), (13, 6), (5, 12)])
def test_ranks_partition_each_step_and_tail_ignores_world(tail, n, global_batch):
    """For every world size dividing the global batch: rank batches interleave to the global step,
    and the global sequence (tail included) is the same for every world size."""
    reference = None
    for world in [w for w in range(1, global_batch + 1) if global_batch % w == 0]:
        steps = steps_per_epoch(n, global_batch, tail)
        sequence = []
        for step in range(steps):
            per_rank = [step_positions(step, r, world, global_batch, n, tail) for r in range(world)]
            merged = np.empty(sum(len(x) for x in per_rank), dtype=np.int64)
            for r, positions in enumerate(per_rank):
                merged[r::world] = positions
            sequence.extend(merged.tolist())
        if reference is None:
            reference = sequence
        assert sequence == reference, f"world {world} changes the sequence"
    length = epoch_length(n, global_batch, tail)
    expected = [p % n for p in range(length)] if n else []
    assert reference == expected
    if tail == "pad" and n:
        assert length % global_batch == 0
        assert padded_samples(n, global_batch, tail) == length - n
    if tail == "drop":
        assert length == (n // global_batch) * global_batch


@pytest.mark.parametrize("tail", ["pad", "drop", "partial"])
def test_step_counts_are_those_of_step_positions(tail):
    """The arithmetic counts equal the positions' size and padding, exhaustively."""
    for n in range(0, 30):
        for global_batch in range(1, 13):
            for world in [w for w in range(1, global_batch + 1) if global_batch % w == 0]:
                for step in range(steps_per_epoch(n, global_batch, tail) + 1):
                    for rank in range(world):
                        positions = np.arange(step * global_batch + rank,
                                              min(step * global_batch + global_batch,
                                                  epoch_length(n, global_batch, tail)), world)
                        assert step_counts(step, rank, world, global_batch, n, tail) == (
                            len(step_positions(step, rank, world, global_batch, n, tail)),
                            int(np.count_nonzero(positions >= n))), (n, global_batch, world, step, rank)


def test_pad_gives_every_rank_equal_full_batches():
    n, world, per_rank = 10, 3, 2
    g = world * per_rank
    for step in range(steps_per_epoch(n, g, "pad")):
        sizes = {len(step_positions(step, r, world, g, n, "pad")) for r in range(world)}
        assert sizes == {per_rank}


def test_world_must_divide_global_batch():
    with pytest.raises(ValueError, match="not a multiple of the world size"):
        step_positions(0, 0, 3, 8, 100, "pad")


# -- simulation: world sizes 1..1024 --------------------------------------------------------
def test_world_sizes_1_to_1024_same_global_sequence_disjoint_ranks_and_locality():
    rng = np.random.default_rng(5)
    sizes = rng.integers(50, 150, 400)  # 400 shards, ~40k samples
    n = int(sizes.sum())
    partitions = 1024
    order = EpochOrder(sizes, 11, 3, ShuffleSettings(partitions=partitions, window=2))
    sequence = order.samples_at(np.arange(n))
    assert np.array_equal(np.sort(sequence), np.arange(n))
    shard_of = order.shards_of(sequence)
    positions = np.arange(n)
    for world in range(1, 1025):
        rank_of = positions % world  # p = r (mod W): rank r's positions across all steps
        # union of ranks = the epoch, ranks disjoint: each position has exactly one rank, and
        # the global sequence is the same object for every world size (it never mentions W).
        counts = np.bincount(rank_of, minlength=world)
        assert counts.sum() == n and counts.max() - counts.min() <= 1
        if partitions % world == 0 or world % partitions == 0:
            # locality: every sample a rank reads lies in a partition = rank (mod W)
            partition_of = _partition_of_samples(order)[sequence]
            assert np.array_equal(partition_of % min(world, partitions), rank_of % min(world, partitions))
    # download volume: with W dividing P, ranks share only lane-boundary shards
    for world in (2, 8, 64, 1024):
        touched = [np.unique(shard_of[r::world]) for r in range(world)]
        total = sum(t.size for t in touched)
        assert total <= sizes.size + order.settings.lanes


def test_ten_to_the_eight_samples_resume_cost_is_flat():
    """Computing one batch anywhere in an epoch of 10^8 samples needs no O(N) memory or time."""
    timings, peaks = {}, {}
    for n_shards in (10, 1_000, 10_000):  # 10^5 .. 10^8 samples at 10^4 samples per shard
        sizes = np.full(n_shards, 10_000)
        tracemalloc.start()
        start = time.perf_counter()
        order = EpochOrder(sizes, 3, 7, ShuffleSettings())
        n = order.num_samples
        batch = order.samples_at(np.arange(n - 64, n))
        timings[n] = time.perf_counter() - start
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert batch.size == 64 and len(set(batch.tolist())) == 64
        assert batch.min() >= 0 and batch.max() < n
    # 10^8 samples: memory is O(shards) (a few arrays of 10^4 int64), far below O(N).
    assert peaks[10**8] < 2_000_000, peaks
    assert peaks[10**8] < 10**8 / 50


def test_resumed_positions_match_a_full_pass_at_large_n():
    sizes = np.full(1_000, 1_000)  # 10^6 samples
    order = EpochOrder(sizes, 0, 0, ShuffleSettings(partitions=16, window=3))
    full = order.samples_at(np.arange(order.num_samples))
    assert np.array_equal(np.sort(full), np.arange(order.num_samples))
    fresh = EpochOrder(sizes, 0, 0, ShuffleSettings(partitions=16, window=3))
    for start in (0, 1, 123_457, 999_936):
        assert np.array_equal(fresh.samples_at(np.arange(start, start + 64)), full[start:start + 64])


# -- mixing and rank coverage (issue 13) ----------------------------------------------------
CLASSES, BATCH = 10, 32


def _uniform_distinct_classes(class_sizes: np.ndarray, batch: int) -> float:
    """Expected distinct classes in `batch` samples drawn uniformly without replacement."""
    n = int(class_sizes.sum())
    absent = [np.prod([(n - c - i) / (n - i) for i in range(batch)]) for c in class_sizes]
    return float(len(class_sizes) - sum(absent))


def _distinct_classes_per_batch(sizes, label, world=1, epochs=4, seed=0) -> float:
    """Mean distinct labels per rank batch over `epochs`, with the default shuffle settings."""
    sizes = np.asarray(sizes)
    n, counts = int(sizes.sum()), []
    for epoch in range(epochs):
        sequence = EpochOrder(sizes, seed, epoch, ShuffleSettings()).samples_at(np.arange(n))
        for rank in range(world):
            mine = sequence[rank::world]
            for start in range(0, mine.size - BATCH + 1, BATCH):
                counts.append(np.unique(label[mine[start:start + BATCH]]).size)
    return float(np.mean(counts))


@pytest.mark.parametrize("shards", [1, 3, 8, 30, 64])
def test_class_sorted_shards_mix_like_a_uniform_shuffle(shards):
    """The issue's case: an image folder converted class by class with the source order kept.
    With the default settings (16 resident shards) a batch holds >= 0.9 of a uniform shuffle's
    distinct classes (version 1: 0.85 at 30 shards, 8.2 against 9.7)."""
    n = 7680
    sizes = np.full(shards, n // shards)
    sizes[: n - sizes.sum()] += 1
    label = np.arange(n) * CLASSES // n  # class-sorted
    uniform = _uniform_distinct_classes(np.bincount(label), BATCH)
    ratio = _distinct_classes_per_batch(sizes, label) / uniform
    assert ratio >= 0.9, ratio


@pytest.mark.parametrize("shards", [1, 8, 64])
def test_shuffled_shards_mix_like_a_uniform_shuffle(shards):
    """convert's default: samples written in a seeded random order. >= 0.97 of uniform."""
    n = 7680
    sizes = np.full(shards, n // shards)
    written = keyed_permutation(n, 1234)  # written[j] = source sample stored at index j
    label = (written * CLASSES // n)
    uniform = _uniform_distinct_classes(np.bincount(label), BATCH)
    ratio = _distinct_classes_per_batch(sizes, label) / uniform
    assert ratio >= 0.97, ratio


def _rank_sets(sizes, world, epoch, per_rank=8, seed=0, tail="drop"):
    """The samples each rank reads in `epoch`, through the loader's own StepPlan."""
    from shardloader.loader.plan import StepPlan

    sizes = np.asarray(sizes)
    g = per_rank * world
    steps = steps_per_epoch(int(sizes.sum()), g, tail)
    out = []
    for rank in range(world):
        plan = StepPlan(sizes, seed, ShuffleSettings(), rank, world, g, tail)
        out.append(np.unique(np.concatenate([plan.samples(epoch, s) for s in range(steps)])))
    return out


@pytest.mark.parametrize("sizes", [[960], [300, 420, 240]], ids=["1-shard", "3-shards"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_sees_every_sample_over_the_epochs(sizes, world):
    """Version 1 gave each rank the same rows of a dataset with fewer shards than partitions in
    every epoch (with 2 ranks, rank 0 never saw half the data). Now a sample's rank is drawn
    afresh each epoch, as with torch's DistributedSampler: consecutive epochs share about 1/W of
    a rank's samples, and within 40 epochs every rank has seen every sample."""
    n = sum(sizes)
    seen = np.zeros((world, n), dtype=bool)
    previous = None
    for epoch in range(40):
        ranks = _rank_sets(sizes, world, epoch)
        for rank, samples in enumerate(ranks):
            seen[rank, samples] = True
            if previous is not None:
                shared = np.intersect1d(samples, previous[rank]).size / samples.size
                assert abs(shared - 1 / world) < 0.12, (epoch, rank, shared)
        previous = ranks
    assert seen.all(), [int((~row).sum()) for row in seen]


def test_rank_assignment_is_a_pure_function_of_the_epoch():
    """Coverage comes from the epoch, never from state: recomputing an epoch gives the same split."""
    first = _rank_sets([300, 420, 240], 4, 7)
    again = _rank_sets([300, 420, 240], 4, 7)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def _most_open_shards(shards: np.ndarray) -> int:
    """Most shards open at once in a read sequence (open: from a shard's first to last read):
    the cache, in shards, a reader needs to download each shard once per epoch."""
    ids, first = np.unique(shards, return_index=True)
    _, last_rev = np.unique(shards[::-1], return_index=True)
    last = shards.size - 1 - last_rev
    events = np.zeros(shards.size + 1, dtype=np.int64)
    np.add.at(events, first, 1)
    np.add.at(events, last + 1, -1)
    return int(np.cumsum(events).max())


@pytest.mark.parametrize("shards", [8, 16, 30, 64, 200])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_resident_shards_per_rank_stay_within_the_budget(shards, world):
    """A rank needs at most ceil(partitions / W) * window shards to read each shard once per
    epoch — the budget of version 1. Shards cut at lane ends are read in both lanes at the same
    time (else they would stay open all epoch: 24 instead of 16 at 64 shards)."""
    rng = np.random.default_rng(shards * 10 + world)
    budget = -(-8 // world) * 2
    for epoch in range(3):
        order = EpochOrder(rng.integers(50, 150, shards), 0, epoch, ShuffleSettings())
        sequence = order.samples_at(np.arange(order.num_samples))
        for rank in range(world):
            assert _most_open_shards(order.shards_of(sequence[rank::world])) <= budget


@pytest.mark.parametrize("tail", ["drop", "pad", "partial"])
def test_step_plan_blocks_give_each_steps_own_samples(tail):
    """StepPlan computes BLOCK_STEPS steps in one call; each step's samples must equal that
    step computed alone, whatever order steps are asked in (workers take every W-th step),
    across block boundaries, the epoch's last (short or padded) step and other ranks."""
    from shardloader.loader.plan import BLOCK_STEPS, StepPlan

    sizes = np.asarray([300, 420, 241])
    world, per_rank = 2, 2
    steps = steps_per_epoch(int(sizes.sum()), per_rank * world, tail)
    assert steps > 3 * BLOCK_STEPS
    asked = list(range(1, steps, 2)) + list(range(steps - 1, -1, -2)) + [0, steps - 1, 5]
    for rank in range(world):
        plan = StepPlan(sizes, 4, ShuffleSettings(shuffle=True), rank, world, per_rank * world, tail)
        alone = StepPlan(sizes, 4, ShuffleSettings(shuffle=True), rank, world, per_rank * world, tail)
        for epoch in (0, 3):
            for step in asked:
                expected = alone.order(epoch).samples_at(alone.positions(step))
                got = plan.samples(epoch, step)
                assert got.tolist() == expected.tolist(), (rank, epoch, step)
        other = 1 - rank
        assert plan.samples(0, 2, other).tolist() == alone.order(0).samples_at(alone.positions(2, other)).tolist()
