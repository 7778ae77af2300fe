"""The loader pauses the garbage collector only inside its own start-up code."""

from __future__ import annotations

import gc

import pytest

from shardloader import Dataset, Loader
from shardloader.ingest.writer import write_shards
from shardloader.runtime.startup import paused_gc
from tests.sample_transforms import make_samples, noisy_crop


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("startup-ds")
    write_shards(make_samples(60), str(out), shard_samples=20)
    return str(out)


def test_paused_gc_restores_the_collector_also_on_errors(gc_enabled):
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), paused_gc():
        raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_the_application_disabled_stays_disabled(gc_enabled):
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_user_code_never_runs_with_the_collector_paused(dataset_dir, gc_enabled, num_workers):
    seen = []
    loader = Loader(Dataset(dataset_dir), batch_size=8, num_workers=num_workers, transform=noisy_crop,
                    seed=1, shuffle=True)
    try:
        seen.append(gc.isenabled())  # after the constructor
        it = iter(loader)
        seen.append(gc.isenabled())  # after the workers started
        next(it)
        seen.append(gc.isenabled())  # after the first batch
        rest = list(it)
        seen.append(gc.isenabled())
        assert len(rest) == len(loader) - 1
    finally:
        loader.close()
    assert seen == [True, True, True, True]


def test_building_a_dataset_pauses_the_collector_and_restores_it(dataset_dir, gc_enabled, monkeypatch):
    """A remote Dataset imports the cache stack and loads the index on the path to the first
    batch: a full collection there cost ~80 ms of a cold first batch (benchmarks.speed)."""
    import shardloader.dataset.sharded as dataset_module

    during = []
    real = dataset_module.load_index
    monkeypatch.setattr(dataset_module, "load_index",
                        lambda *a, **k: (during.append(gc.isenabled()), real(*a, **k))[1])
    Dataset(dataset_dir)
    assert during == [False]
    assert gc.isenabled()
