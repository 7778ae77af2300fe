"""benchmarks/floors.py: its two per-sample loops do the same work (the same pixels), and each
of its measurements runs and cleans up after itself."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from benchmarks import floors
from shardloader import Dataset


def test_the_fused_and_the_user_loop_write_the_same_rows(jpeg_dataset):
    """Else the floor would compare different work."""
    dataset = Dataset(jpeg_dataset.path)
    samples = np.arange(12)
    size = floors.SIZE
    fused = np.zeros((12, 3, size, size), np.uint8)
    user = np.ones((12, 3, size, size), np.uint8)
    hwc, scratch = np.empty((size, size, 3), np.uint8), np.empty((size, size, 3), np.uint8)
    floors.fused_rows(dataset, samples, fused, torch.Generator(), hwc, scratch)
    floors.user_rows(dataset, samples, user, torch.Generator())
    assert np.array_equal(fused, user)
    assert len({fused[i].tobytes() for i in range(12)}) == 12  # real images, each its own


def test_the_own_function_floor_times_every_way(jpeg_dataset):
    best = floors.own_function_floor(jpeg_dataset.path, repeats=2)
    assert list(best) == ["fused", "user's work", "Loader, README", "Loader, user's function"]
    assert all(0 < us < float("inf") for us in best.values())


def test_the_wake_up_cost_times_both_ways_and_leaves_no_waiter():
    before = set(multiprocessing.active_children())  # another test's children are not its own
    costs = floors.wake_cost(3, sleep_s=0.001)
    assert set(costs) == {"pipe write", "semaphore release"}
    assert all(us > 0 for us in costs.values())
    assert set(multiprocessing.active_children()) - before == set()


def test_ready_next_counts_the_batches_it_timed(jpeg_dataset):
    ready = floors.ready_next(jpeg_dataset.path, step_ms=20.0, batches=6, batch_size=8)
    assert ready["of"] == 6 and 1 <= ready["ready"] <= 6
    assert ready["median_us"] > 0 and 0 < ready["floor"] < 1


def test_ready_next_refuses_an_epoch_of_one_batch(jpeg_dataset):
    with pytest.raises(ValueError, match="1 batch of 64"):
        floors.ready_next(jpeg_dataset.path, step_ms=1.0, batches=2)
