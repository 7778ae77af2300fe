"""Lazy global seeding (`order.global_rngs`): a transform that draws from `random` or legacy
`numpy.random` gets exactly the draws of eager per-sample seeding (I3), however and whenever
it draws; one that never draws from them is never re-run and never pays for seeding them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shardloader import Dataset, Loader
from shardloader.ingest.writer import write_shards
from shardloader.loader.batches import BatchProducer, BatchTask
from shardloader.order.global_rngs import LazyGlobalRngScope, _watch
from shardloader.order.seeding import sample_generator, sample_key
from tests.resume import assert_identical
from tests.sample_transforms import make_samples

SEED = 13


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("lazy-rng")
    write_shards(make_samples(48, seed=4), str(out), shard_samples=16)
    return Dataset(str(out))


def _python_draws(sample):
    return {"x": torch.tensor([random.random(), random.randint(0, 99)]), "label": sample["label"]}


def _numpy_draws(sample):
    return {"x": torch.from_numpy(np.random.randint(0, 1000, 3)), "label": sample["label"]}


def _some_samples_draw(sample):
    """Draws from numpy for labels 3 and 5 only, from random for label 6 only."""
    x = np.zeros(2)
    if sample["label"] in (3, 5):
        x[0] = np.random.rand()
    if sample["label"] == 6:
        x[1] = random.random()
    return {"x": torch.from_numpy(x), "label": sample["label"]}


def _gaussians(sample):
    """One normal each: both generators make them in pairs and keep the second for the next
    call, which then draws no state word."""
    return {"x": torch.tensor([random.gauss(0, 1), float(np.random.randn())])}


def _changes_its_record(sample):
    """Changes the record it is given before it draws: a second run must see the original."""
    sample["label"] = sample["label"] * 10 + random.randint(0, 9)
    sample["data"] = sample["data"][:4]
    return sample


def _fails_unless_seeded(sample):
    """Raises when its numpy draw is not the seeded one: the error of an unseeded first run
    must never be reported."""
    key = sample_key(SEED, _fails_unless_seeded.epoch, int(sample["__index__"]))
    expected = np.random.RandomState([key & 0xFFFF_FFFF, key >> 32]).randint(0, 2**31)
    got = np.random.randint(0, 2**31)
    if got != expected:
        raise ValueError(f"unseeded draw {got}")
    return {"x": torch.tensor(got), "label": sample["label"]}


_fails_unless_seeded.epoch = 0


#: The first draw of numpy's known state at a scope's entry (`seed_numpy(0)`).
_UNSEEDED = np.random.RandomState([0, 0]).rand()


def _draws_random_if_numpy_says(sample):
    """Draws from random only when its numpy draw lies on the other side of 0.5 than the
    unseeded state's first draw: an unseeded first run never draws from random, while the
    seeded run of the same sample may."""
    x = float(np.random.rand())
    y = random.random() if (x < 0.5) != (_UNSEEDED < 0.5) else -1.0
    return {"x": torch.tensor([x, y]), "label": sample["label"]}


def _generator_only(sample, generator):
    _generator_only.calls += 1
    return {"x": torch.rand(2, generator=generator) + torch.rand(1), "label": sample["label"]}


_generator_only.calls = 0


def _reference(ds, transform, epoch, samples):
    """The contract written out: every global RNG seeded from the sample's key before it."""
    out = []
    for s in samples:
        key = sample_key(SEED, epoch, s)
        random.seed(key)
        np.random.seed([key & 0xFFFF_FFFF, key >> 32])
        torch.manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
        record = ds[s]
        result = (transform(record, generator=sample_generator(key)) if transform is _generator_only
                  else transform(record))
        result.setdefault("__index__", s)
        out.append(result)
    return default_collate(out)


def test_the_states_of_random_and_numpy_are_read_in_place_here():
    """Else every test below would pass through eager seeding and prove nothing lazy."""
    assert _watch("random") is not None
    assert _watch("numpy") is not None


@pytest.mark.parametrize("transform", [_python_draws, _numpy_draws, _some_samples_draw, _gaussians,
                                       _changes_its_record, _fails_unless_seeded, _generator_only])
def test_lazy_seeding_gives_the_eager_draws(dataset, transform):
    producer = BatchProducer(dataset, seed=SEED, transform=transform)
    for epoch, samples in [(0, [7, 3, 40, 3, 21, 0, 33, 12]), (1, [5, 6, 13, 47, 29]),
                           (2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])]:
        _fails_unless_seeded.epoch = epoch
        random.gauss(0, 1)  # leave a cached normal in each process stream
        np.random.randn()
        batch, _ = producer(BatchTask(epoch, epoch, 0, np.array(samples)))
        assert_identical(batch, _reference(dataset, transform, epoch, samples), f"epoch {epoch}")


def test_a_seeded_run_that_draws_from_another_generator_runs_again(dataset):
    """The first sample to draw from numpy takes, once seeded, a branch that draws from random
    too, which the unseeded run did not: that draw must be seeded as well."""
    def seeded_numpy(s):
        key = sample_key(SEED, 0, s)
        return np.random.RandomState([key & 0xFFFF_FFFF, key >> 32]).rand()

    first = next(s for s in range(48) if (seeded_numpy(s) < 0.5) != (_UNSEEDED < 0.5))
    samples = [first] + [s for s in range(48) if s != first][:7]
    producer = BatchProducer(dataset, seed=SEED, transform=_draws_random_if_numpy_says)
    batch, _ = producer(BatchTask(0, 0, 0, np.array(samples)))
    assert_identical(batch, _reference(dataset, _draws_random_if_numpy_says, 0, samples))
    assert producer._globals_in_use == {"numpy", "random"}


def test_a_transform_that_never_draws_from_them_runs_once_per_sample(dataset):
    producer = BatchProducer(dataset, seed=SEED, transform=_generator_only)
    _generator_only.calls = 0
    for step in range(3):
        producer(BatchTask(step, 0, step, np.arange(step * 8, step * 8 + 8)))
    assert _generator_only.calls == 24
    assert producer._globals_in_use == set()  # neither random nor numpy was ever seeded


def test_a_drawing_transform_runs_one_extra_time_per_generator_and_process(dataset):
    calls = []

    def counted(sample):
        calls.append(int(sample["__index__"]))
        return _some_samples_draw(sample)

    producer = BatchProducer(dataset, seed=SEED, transform=counted)
    samples = [int(i) for i in range(48) if dataset[i]["label"] in (0, 1, 3, 6, 5)][:12]
    producer(BatchTask(0, 0, 0, np.array(samples)))
    producer(BatchTask(1, 1, 0, np.array(samples)))
    assert len(calls) == 2 * len(samples) + 2  # the first 3 (numpy) and the first 6 (random)
    assert producer._globals_in_use == {"numpy", "random"}


def test_the_scope_restores_the_process_streams_and_seeds_torch_always():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    in_use: set[str] = set()
    with LazyGlobalRngScope(in_use) as scope:
        scope.seed(99)
        assert torch.initial_seed() == 99
        assert scope.watching and scope.moved() == []
        np.random.rand()
        assert scope.moved() == ["numpy"]
        scope.promote(["numpy"])
        assert in_use == {"numpy"} and scope.watching
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_batches_with_lazy_seeding_are_the_contract_s(dataset, num_workers):
    """Through real worker processes, each its own process-wide set of generators in use."""
    loader = Loader(dataset, batch_size=5, shuffle=True, seed=SEED, num_workers=num_workers,
                    transform=_some_samples_draw)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            samples = batch["__index__"].tolist()
            assert_identical(batch, _reference(dataset, _some_samples_draw, epoch, samples))
    loader.close()
