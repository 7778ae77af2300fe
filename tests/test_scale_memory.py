"""Per-process order memory at scale (issue 24): what each worker holds must not grow with the
shard count, and making it smaller must not move any order.

- A forked worker uses the epoch order its parent built before the fork (shared copy-on-write),
  not one of its own: checked with real worker processes, by object identity (a forked child's
  objects keep their parent's addresses; one it built itself has a new one).
- What one order keeps is a fixed number of bytes per shard (pieces and windows), and the shard
  offsets are made once per plan, not once per epoch.
- The sequences are those of the implementation before the change (pinned digests).
"""

from __future__ import annotations

import gc
import hashlib
import os

import numpy as np
import pytest

from shardloader import Dataset, Loader, write_shards
from shardloader.loader.plan import StepPlan
from shardloader.order.shuffle import EpochOrder, ShuffleSettings


def _orders_here(batch: list) -> dict:
    """collate_fn run in the worker: this process's pid and the EpochOrders alive in it (the
    inherited objects are frozen out of the collector's view in a worker: unfrozen to list them)."""
    gc.unfreeze()
    orders = [(id(o), o.epoch) for o in gc.get_objects() if type(o) is EpochOrder]
    return {"pid": os.getpid(), "orders": orders, "n": len(batch)}


@pytest.fixture
def orders_before() -> list[EpochOrder]:
    """The EpochOrders alive in this process before the test (other tests' loaders, not yet
    collected): forked workers inherit them too, so the test counts only the others. Held for
    the test, so that no new order takes the address (the id) of one of them."""
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is EpochOrder]


def _new(orders: list, before: list[EpochOrder]) -> list:
    old = {id(o) for o in before}
    return [(oid, e) for oid, e in orders if oid not in old]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("scale-memory") / "ds")
    write_shards(({"label": i} for i in range(240)), root, shard_samples=4, progress=False)
    return root


@pytest.mark.parametrize("epochs", [1, 2])
def test_forked_workers_use_the_order_their_parent_built(sharded, epochs, orders_before):
    """Each epoch's workers (not persistent: forked again per epoch) find that epoch's order in
    the plan they inherit, the very object the training process built, and build none."""
    loader = Loader(Dataset(sharded), batch_size=8, shuffle=True, num_workers=2, collate_fn=_orders_here)
    try:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            batches = list(loader)
            parent = id(loader.epoch_order(epoch))
            seen = {b["pid"] for b in batches}
            assert len(seen) == 2 and os.getpid() not in seen
            for b in batches:
                built = {oid for oid, e in _new(b["orders"], orders_before) if e == epoch}
                assert built == {parent}, (epoch, b["pid"], built, parent)
    finally:
        loader.close()


def test_persistent_workers_hold_one_order_of_their_own(sharded, orders_before):
    """Persistent workers build the later epochs' orders themselves; each keeps only the epoch
    it works on (the training process keeps two), so what they hold does not pile up: at
    epoch 2, one order (20 bytes per shard), not two."""
    loader = Loader(Dataset(sharded), batch_size=8, shuffle=True, num_workers=2, persistent_workers=True,
                    collate_fn=_orders_here)
    try:
        pids = set()
        for epoch in range(3):
            loader.set_epoch(epoch)
            for b in loader:
                pids.add(b["pid"])
                assert [e for _, e in _new(b["orders"], orders_before)] == [epoch], (epoch, b["orders"])
        assert len(pids) == 2  # the same two workers all along
    finally:
        loader.close()


def _plan(shards: int) -> StepPlan:
    sizes = np.random.default_rng(shards).integers(1, 9, shards).astype(np.int64)
    return StepPlan(sizes, 3, ShuffleSettings(), 0, 1, 64, "partial")


def test_an_orders_arrays_cost_a_fixed_number_of_bytes_per_shard():
    """10^3 vs 10^5 shards: bytes per shard of what an order makes are the same (about 20:
    16 per piece, 8 per window of about two pieces), and every epoch's order uses the plan's
    one offsets array."""
    per_shard = {}
    for shards in (1_000, 100_000):
        plan = _plan(shards)
        orders = [plan.order(e) for e in (0, 1)]
        assert orders[0].shard_offsets is orders[1].shard_offsets is plan.shard_offsets
        per_shard[shards] = orders[0].nbytes() / shards
        assert all(a.dtype.itemsize == 4 for a in (orders[0].piece_shard, orders[0].piece_row))
    assert per_shard[100_000] <= 21
    assert per_shard[1_000] <= 22  # plus the lanes' and partitions' few hundred bytes


# (sizes, seed, epoch, partitions, window) -> sha256 of samples_at(arange(N)) as little-endian
# int64: computed with the order code as it was before its arrays were made smaller.
_PINNED = [
    ([], 0, 0, 8, 2, "e3b0c44298fc1c14"),
    ([5], 1, 0, 8, 2, "e964011bf5412396"),
    ([0, 3, 0, 0, 7, 0], 2, 1, 8, 2, "90f15be615eb0514"),
    ([1] * 5, 3, 2, 4, 3, "83e35dc1efab97af"),
    ("random300", 4, 5, 8, 2, "cc01cb0d77514ecf"),
    ("random2000", 5, 0, 3, 1, "0aa9e2e0bcbc4066"),
    ("random400", 0, 9, 16, 4, "ca3dda7d97334b4c"),
    ([4] * 100_000, 0, 0, 8, 2, "25a88e9b400488ed"),
]


def _sizes(spec: object) -> np.ndarray:
    rng = np.random.default_rng(7)  # drawn in the pinned order, as when the digests were made
    drawn = {"random300": rng.integers(0, 40, 300), "random2000": rng.integers(1, 3, 2000),
             "random400": rng.integers(50, 150, 400)}
    return np.asarray(drawn[spec] if isinstance(spec, str) else spec, dtype=np.int64)


@pytest.mark.parametrize("sizes, seed, epoch, partitions, window, digest", _PINNED)
def test_orders_are_those_of_before(sizes, seed, epoch, partitions, window, digest):
    order = EpochOrder(_sizes(sizes), seed, epoch, ShuffleSettings(partitions=partitions, window=window))
    out = order.samples_at(np.arange(order.num_samples)).astype("<i8")
    assert hashlib.sha256(out.tobytes()).hexdigest()[:16] == digest


def test_orders_with_rows_past_int32_are_those_of_before():
    """Shards of more than 2**31 samples keep int64 rows; sampled positions (N ~ 10^10)."""
    order = EpochOrder(np.array([2**33 + 5, 7, 2**31 + 1]), 6, 3, ShuffleSettings())
    assert order.piece_row.dtype == np.int64
    positions = np.unique(np.random.default_rng(1).integers(0, order.num_samples, 200_000))
    out = order.samples_at(positions).astype("<i8")
    assert hashlib.sha256(out.tobytes()).hexdigest()[:16] == "55a887fa8a27d6fb"


def test_a_plan_given_the_index_offsets_uses_them_and_orders_the_same():
    """`StepPlan(..., offsets=index.sample_offsets)`: no second offsets array, same samples;
    offsets that are not the sizes' prefix sums are refused."""
    sizes = np.random.default_rng(5).integers(0, 9, 500).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    given = StepPlan(sizes, 3, ShuffleSettings(), 1, 2, 64, "pad", offsets=offsets)
    made = StepPlan(sizes, 3, ShuffleSettings(), 1, 2, 64, "pad")
    assert given.order(2).shard_offsets is offsets
    for step in range(0, 40, 7):
        assert np.array_equal(given.samples(2, step), made.samples(2, step))
    narrow = StepPlan(sizes, 3, ShuffleSettings(), 1, 2, 64, "pad", offsets=offsets.astype(np.int32))
    assert np.array_equal(narrow.samples(2, 7), made.samples(2, 7))  # another int dtype: converted
    for bad in (offsets[1:], offsets + 1):
        with pytest.raises(ValueError, match="prefix sums"):
            StepPlan(sizes, 3, ShuffleSettings(), 0, 1, 64, "pad", offsets=bad).order(0)
