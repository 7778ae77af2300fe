"""Worker pools: process workers yield the CPU to the training process, and the shared-memory
slots that carry their batches are reused, also across abandoned iterations."""

from __future__ import annotations

import os

import pytest
import torch

from shardloader import Dataset, Loader
from shardloader.format.writer import write_shards
from tests.sample_transforms import make_samples, noisy_crop


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("workers-ds")
    write_shards(make_samples(300), str(out), shard_samples=40)
    return str(out)


def make(dataset_dir, **kw):
    args = dict(batch_size=8, seed=3, transform=noisy_crop, partitions=4, window=2,
                num_workers=2, worker_type="process", shuffle=True, tail="pad", persistent_workers=True)
    args.update(kw)
    return Loader(Dataset(dataset_dir), **args)


def test_process_workers_run_at_a_lower_priority_than_the_loader(dataset_dir):
    loader = make(dataset_dir)
    try:
        next(iter(loader))
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        for pid in loader._pool.pids():
            assert os.getpriority(os.PRIO_PROCESS, pid) > mine
    finally:
        loader.close()


def test_abandoned_iterations_give_their_slots_back(dataset_dir):
    first = next(iter(make(dataset_dir, num_workers=0)))
    loader = make(dataset_dir, prefetch_factor=2)
    start = loader.state_dict()
    try:
        for _ in range(12):  # take one batch, abandon the iteration with 3 more in flight
            loader.load_state_dict(start)
            assert torch.equal(next(iter(loader))["crop"], first["crop"])
        assert len(list(loader)) == len(loader) - 1  # the rest of the epoch, in full
        # Abandoned results still arrive and must give their slots back: without that each
        # round would leave ~3 slots behind (36 here). With it a worker holds only the slots
        # of results not yet drained: at most the 4 tasks a round submits, plus one.
        assert len(loader._pool._slots._slots) <= 2 * (4 + 1)
    finally:
        loader.close()
