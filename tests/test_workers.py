"""Worker pools: process workers yield the CPU to the training process, and the shared-memory
slots that carry their batches are reused, also across abandoned iterations."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from shardloader import Dataset, Loader
from shardloader.ingest.writer import write_shards
from shardloader.loader.batches import BatchTask
from shardloader.loader.workers import pool as workers
from shardloader.loader.workers import slots
from tests.resume import assert_identical
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
    """Each worker lowers its own priority first thing; one that has not run yet (a loaded
    machine) is waited for, up to a deadline, rather than read before it did."""
    loader = make(dataset_dir)
    try:
        next(iter(loader))
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        pids = loader._pool.pids()
        assert len(pids) == loader.num_workers
        deadline = time.monotonic() + 30
        while (higher := [os.getpriority(os.PRIO_PROCESS, pid) > mine for pid in pids]) != [True] * len(pids):
            assert time.monotonic() < deadline, f"workers' priorities {higher} vs the loader's {mine}"
            time.sleep(0.01)
    finally:
        loader.close()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cyclic_garbage(sample):
    """Leaves 1 MB behind in a ring of 50 lists, which only the garbage collector frees (as a
    caught exception's traceback, or many libraries' objects, would); reports the worker."""
    ring = [[] for _ in range(50)]
    for node, following in zip(ring, ring[1:] + ring[:1]):
        node.append(following)
    ring[0].append(bytearray(1 << 20))
    return {"pid": os.getpid(), "collecting": gc.isenabled(), "resident": _resident_bytes()}


def test_workers_collect_cyclic_garbage(dataset_dir, gc_enabled):
    """Workers fork while the loader starts, with the collector paused (shardloader.runtime.startup); they
    must switch it back on, or each of these 300 samples' 1 MB would stay in its worker."""
    loader = make(dataset_dir, transform=cyclic_garbage, shuffle=False)
    try:
        batches = list(loader)
    finally:
        loader.close()
    pids = torch.cat([b["pid"] for b in batches])
    resident = torch.cat([b["resident"] for b in batches])
    assert len(set(pids.tolist())) == 2 and os.getpid() not in pids.tolist()
    assert all(bool(b["collecting"].all()) for b in batches)
    for pid in set(pids.tolist()):
        mine = resident[pids == pid]
        growth = int(mine.max() - mine[0])
        assert growth < 64 << 20, f"worker {pid} grew by {growth >> 20} MB over {len(mine)} samples"


def test_workers_leave_the_collector_off_where_the_application_switched_it_off(dataset_dir, gc_enabled):
    loader = make(dataset_dir, transform=cyclic_garbage, persistent_workers=False)
    gc.disable()  # gc_enabled puts it back
    try:
        batches = list(loader)
    finally:
        loader.close()
    assert not any(bool(b["collecting"].any()) for b in batches)


def test_abandoned_iterations_give_their_slots_back(dataset_dir):
    first = next(iter(make(dataset_dir, num_workers=0)))
    loader = make(dataset_dir, prefetch_factor=2)
    start = loader.state_dict()
    try:
        for _ in range(24):  # take one batch, abandon the iteration with 3 more in flight
            loader.load_state_dict(start)
            assert torch.equal(next(iter(loader))["crop"], first["crop"])
        assert len(list(loader)) == len(loader) - 1  # the rest of the epoch, in full
        # Abandoned results still arrive and must give their slots back: without that each
        # round would leave ~3 slots behind (72 here). With it a worker holds only the slots
        # of results not yet drained (at most the 4 tasks a round submits), one more whose
        # return is still on its way when the worker packs its next batch, and one for a
        # result of the previous round the receiver has not reached yet under load.
        assert len(loader._pool._slots._slots) <= 2 * (4 + 2)
    finally:
        loader.close()


def test_kept_batches_stay_exact_and_their_slots_stay_bounded(dataset_dir):
    """Batches are views of the workers' slots until dropped. A script that keeps every batch
    gets them exact (past the lending limit they are copied), each worker's slots stay few,
    and the kept batches survive the workers (killed) and the closed loader."""
    expected = list(make(dataset_dir, num_workers=0))
    loader = make(dataset_dir)
    try:
        kept = list(loader)
        # Lent (at most LEND_PER_WORKER), in flight (2) and a few on their way back, per worker
        # (12 measured in all); without the lending limit one slot per batch: 38.
        assert len(loader._pool._slots._slots) <= 2 * (slots.LEND_PER_WORKER + 2 + 4)
        pids = loader._pool.pids()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    finally:
        loader.close()
    assert_identical(kept, expected)


def test_a_loop_that_drops_its_batches_reuses_a_few_slots(dataset_dir):
    loader = make(dataset_dir, prefetch_factor=2)
    try:
        for _ in range(3):
            for batch in loader:
                batch["crop"].add_(1)  # in place, in the slot: the user's memory until dropped
        # Per worker: 2 in flight, the one being handed out, the user's, and under load a few
        # dropped ones the receiver has not sent back yet (9 measured in all). A slot never
        # given back would leave one per batch: over 100 here.
        assert len(loader._pool._slots._slots) <= 2 * (2 + 6)
    finally:
        loader.close()


@pytest.mark.parametrize("body_seconds", [0.0, 0.02])
def test_a_worker_keeps_three_slots_for_a_loop_that_drops_each_batch(dataset_dir, body_seconds):
    """With prefetch_factor=2 a worker's batches are: one being made, one waiting, the one the
    loop holds. The slot of the one before goes back when the loop asks for its next batch,
    before the task that reuses it is submitted; a fourth slot per worker would mean it went
    back late. Also with a loop body slower than the workers (every batch then waits)."""
    loader = make(dataset_dir, prefetch_factor=2)
    try:
        for batch in loader:
            batch["crop"].add_(1)
            time.sleep(body_seconds)  # the training step: no synchronisation is involved
        made = [worker for worker, _ in loader._pool._slots._slots]
        assert max(made.count(0), made.count(1)) <= 3, made
    finally:
        loader.close()


def test_batches_waiting_in_a_deep_prefetch_are_lent_not_copied(dataset_dir, monkeypatch):
    """Batches waiting to be taken are lent too: with prefetch_factor=6 all of them can wait
    at once, and none may fall back to the copy meant for scripts that keep every batch."""
    copied = []
    real = slots._copied
    monkeypatch.setattr(slots, "_copied", lambda *a: (copied.append(len(a[0])), real(*a))[1])
    loader = make(dataset_dir, prefetch_factor=6)
    try:
        it = iter(loader)
        next(it)
        deadline = time.monotonic() + 60
        while loader._pool.ready() < 2 * 6 - 1:  # every submitted batch arrived and waits
            assert time.monotonic() < deadline, "the workers did not fill the prefetch"
            time.sleep(0.01)
        assert sum(1 for _ in it) == len(loader) - 1
        assert copied == []
    finally:
        loader.close()


def test_a_task_frame_is_what_the_worker_queue_reads():
    """Tasks are written to a worker's pipe as `Connection.send_bytes` frames them (see
    `workers._task_frame`); the worker's `SimpleQueue.get` must read them back exactly."""
    tasks = multiprocessing.get_context("fork").SimpleQueue()
    try:
        for task in (BatchTask(7, 2, 5, None, 1, 64),
                     BatchTask(8, 0, 1, np.arange(3, dtype=np.int64), 0, 3)):
            os.write(tasks._writer.fileno(), workers._task_frame(task))
            got = BatchTask(*tasks.get())
            assert (got.task_id, got.epoch, got.step, got.padded, got.size) == (
                task.task_id, task.epoch, task.step, task.padded, task.size)
            assert (got.samples is None and task.samples is None) or \
                np.array_equal(got.samples, task.samples)
    finally:
        tasks.close()


def _pipe_ends(pid: int) -> set[tuple[int, str]]:
    """(pipe inode, "r" or "w") of every pipe end process `pid` holds open."""
    ends = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration):
            continue
        if target.startswith("pipe:["):
            ends.add((int(target[6:-1]), "w" if flags & os.O_ACCMODE == os.O_WRONLY else "r"))
    return ends


def _inode(conn) -> int:
    return os.fstat(conn.fileno()).st_ino


def _pool_pipes(pool) -> set[int]:
    queues = [pool._results, *pool._task_queues, *pool._slot_returns]
    return {_inode(q._reader) for q in queues}  # a pipe's two ends share one inode


def test_workers_hold_only_their_own_pipe_ends(dataset_dir):
    """A worker holds the read end of its own task queue, the write end of the result queue and
    the read end of its slot returns — nothing else of its pool or of another live pool. Else
    its task read never sees end-of-file when the training process dies (issue 10)."""
    first, second = make(dataset_dir), make(dataset_dir)
    try:
        next(iter(first))
        next(iter(second))  # its workers were forked while the first pool was alive
        for loader, other in ((first, second), (second, first)):
            pool = loader._pool
            theirs, ours = _pool_pipes(other._pool), _pool_pipes(pool)
            for worker_id, pid in enumerate(pool.pids()):
                held = _pipe_ends(pid)
                expected = {(_inode(pool._task_queues[worker_id]._reader), "r"),
                            (_inode(pool._results._writer), "w"),
                            (_inode(pool._slot_returns[worker_id]._reader), "r")}
                assert {end for end in held if end[0] in ours} == expected
                assert not {end for end in held if end[0] in theirs}
    finally:
        first.close()
        second.close()


_IMPORTS_SCRIPT = """
import json, os, sys
import torch
from shardloader import Dataset, Loader

HEAVY = ("pandas", "numpy.ma", "mlflow")

def report(sample):
    flags = [name in sys.modules for name in HEAVY]
    return {"heavy": torch.tensor(flags), "pid": torch.tensor(os.getpid())}

with Loader(Dataset(sys.argv[1]), batch_size=8, num_workers=2, transform=report, seed=1,
            shuffle=True, persistent_workers=True) as loader:
    batches = list(loader)
pids = sorted({int(p) for b in batches for p in b["pid"].tolist()})
in_workers = sorted({name for b in batches for row in b["heavy"].tolist()
                     for name, there in zip(HEAVY, row) if there})
print(json.dumps({"main": os.getpid(), "pids": pids, "workers": in_workers,
                  "parent": [name for name in HEAVY if name in sys.modules]}))
"""


def test_workers_do_not_import_pandas_numpy_ma_or_mlflow(dataset_dir):
    """What a worker imports costs memory in every worker and time before its first batch:
    reading rows and running the loader must not pull in pandas (pyarrow's `to_numpy` does),
    numpy.ma (numpy's `unique` does) or mlflow (telemetry is the training process's)."""
    out = subprocess.run([sys.executable, "-c", _IMPORTS_SCRIPT, dataset_dir],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["pids"]) == 2 and report["main"] not in report["pids"]  # ran in workers
    assert report["workers"] == []
    assert report["parent"] == []
