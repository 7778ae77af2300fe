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


class _Node:
    """A GC-tracked object in a reference cycle."""

    def __init__(self) -> None:
        self.me = self


def test_what_a_pause_allocated_is_promoted_uncollected(gc_enabled):
    """At the end of a pause its survivors go to the oldest generation without a collection
    (one would walk them all, promote them and set off a full collection in the first next()),
    and none of them was frozen for good."""
    gc.collect()
    collections = []

    def note(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    with paused_gc():
        kept = [_Node() for _ in range(50_000)]
    gc.callbacks.append(note)
    try:
        more = [_Node() for _ in range(500)]  # what the next allocations would have collected
    finally:
        gc.callbacks.remove(note)
    assert 2 not in collections  # (young ones may run: other threads of the suite allocate)
    assert gc.get_freeze_count() == 0
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(kept[0]) in oldest and id(kept[-1]) in oldest
    del kept, more
    assert gc.collect() >= 50_000  # cyclic garbage among them is still collected by a full pass


def test_a_pause_leaves_what_the_application_froze_alone(gc_enabled):
    frozen = [_Node() for _ in range(100)]
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with paused_gc():
            young = _Node()
        # still frozen (one freed meanwhile leaves the list), nothing added
        assert 0 < gc.get_freeze_count() <= before
        assert id(young) not in {id(o) for o in gc.get_objects(generation=2)}
    finally:
        gc.unfreeze()
    del frozen


def test_importing_the_public_names_runs_no_collection_of_the_users_heap():
    """`from shardloader import Dataset, Loader` after `import torch` set off a full collection
    of torch's heap every time (93-126 ms of 0.18-0.30 s): the imports run with the collector
    paused, and it is on again after them."""
    script = (
        "import gc, torch\n"
        "runs = []\n"
        "gc.callbacks.append(lambda phase, info: runs.append(info['generation']) if phase == 'start' else None)\n"
        "from shardloader import Dataset, Loader, Mixture\n"
        "print(runs, gc.isenabled(), gc.get_freeze_count())\n"
    )
    assert _last_line_of(script) == "[] True 0"


def test_a_local_loader_never_imports_the_node_cache(dataset_dir):
    """Local shards are read in place: a fresh process that iterates a local Loader (workers
    included) imports none of the node cache (its store, ledger, sqlite3), whose
    modules cost the training process 1.7 MiB of RSS."""
    script = (
        "import sys\n"
        "from shardloader import Dataset, Loader\n"
        f"loader = Loader(Dataset({str(dataset_dir)!r}), batch_size=4, num_workers=2)\n"
        "for _ in loader: pass\n"
        "loader.close()\n"
        "print(sorted(m for m in sys.modules if m.startswith('shardloader.cache') "
        "or m == 'sqlite3'))\n"
    )
    assert _last_line_of(script) == "[]"


def test_forked_workers_import_nothing_the_training_process_had_not(dataset_dir, tmp_path):
    """A forked worker's set-up (it seeds `numpy.random`, as DataLoader's workers do) and its
    batches import no module the training process had not imported before forking it: each
    worker importing numpy.random itself cost 10-20 ms before its first task and 2.7 MB of
    private memory (benchmarks/coldstart.py's "worker: set-up to first task"). A fresh process;
    the modules each worker holds when `worker_init_fn` runs (after the set-up) and at its last
    sample are compared with the training process's after two batches."""
    import json

    script = (
        "import json, os, sys\n"
        "from shardloader import Dataset, Loader\n"
        "def dump_modules(name):\n"
        f"    with open(os.path.join({str(tmp_path)!r}, name + '.json'), 'w') as f:\n"
        "        json.dump(sorted(sys.modules), f)\n"
        "def note(worker_id):\n"
        "    dump_modules(f'init-{worker_id}')\n"
        "def note_each_sample(sample):\n"
        "    dump_modules(f'batch-{os.getpid()}')\n"
        "    return sample\n"
        f"loader = Loader(Dataset({str(dataset_dir)!r}), batch_size=4, num_workers=2,\n"
        "                worker_init_fn=note, transform=note_each_sample)\n"
        "it = iter(loader)\n"
        "next(it); next(it)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
        "del it\n"
        "loader.close()\n"
    )
    parent = set(json.loads(_last_line_of(script)))
    seen = sorted(tmp_path.glob("init-*.json")) + sorted(tmp_path.glob("batch-*.json"))
    assert len(seen) == 4  # both workers, at set-up and at their last sample
    for path in seen:
        imported_there = sorted(set(json.loads(path.read_text())) - parent)
        assert imported_there == [], f"{path.name}: imported in the worker: {imported_there}"


def _last_line_of(script: str) -> str:
    """The last line `script` printed, run in a fresh interpreter (which must succeed)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]
