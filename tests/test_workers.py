"""Worker pools: process workers yield the CPU to the training process, and the shared-memory
slots that carry their batches are reused, also across abandoned iterations."""

from __future__ import annotations

import collections
import gc
import json
import multiprocessing
import os
import re
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
from tests.integration_runs import readline
from tests.proctree import Proc, descendants, kill_group, wait_gone
from tests.resume import assert_identical, assert_same_batches, record
from tests.sample_transforms import make_samples, noisy_crop


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("workers-ds")
    write_shards(make_samples(300), str(out), shard_samples=40)
    return str(out)


def make(dataset_dir, **kw):
    args = dict(batch_size=8, seed=3, transform=noisy_crop, partitions=4, window=2,
                num_workers=2, worker_type="process", shuffle=True, tail="pad")
    args.update(kw)
    args.setdefault("persistent_workers", args["num_workers"] > 0)  # DataLoader: needs workers
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
        assert len(list(loader)) == len(loader)  # a new iteration: the whole epoch
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


@pytest.mark.parametrize("prefetch_factor", [1, 3])
def test_a_worker_makes_prefetch_factor_plus_one_slots(dataset_dir, prefetch_factor):
    """The bound on the slots a worker creates, for any prefetch_factor: its batches in flight
    (being made or waiting to be taken: prefetch_factor) and the one the loop holds. The
    dropped one before it is back when the loop asks for its next batch, before the task that
    reuses it is submitted."""
    loader = make(dataset_dir, prefetch_factor=prefetch_factor)
    try:
        for _ in range(2):
            for batch in loader:
                batch["crop"].add_(1)
        made = [worker for worker, _ in loader._pool._slots._slots]
        assert max(made.count(0), made.count(1)) <= prefetch_factor + 1, made
    finally:
        loader.close()


def _shared_resident(pid: int) -> int:
    """Bytes of torch shared-memory mappings (the batch slots) in process `pid`'s page tables."""
    total, in_shm = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header line
                in_shm = "/dev/shm/torch_" in line
            elif in_shm and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def wide_crop(sample: dict, generator: torch.Generator) -> dict:
    """noisy_crop with 64 KiB more per sample: batches of 32 fill 2 MiB of a slot."""
    out = noisy_crop(sample, generator)
    return {**out, "wide": torch.full((64 << 10,), sample["label"], dtype=torch.uint8)}


def test_an_idle_worker_maps_none_of_its_slots(dataset_dir):
    """A worker waiting for its next task unmaps its slots' pages (the bytes stay in shared
    memory for the loader): as DataLoader's idle worker maps no batch, where without it each
    would keep the prefetch_factor + 1 slots it cycles through. Checked while the loop holds a
    batch and every other submitted batch waits, and the batches stay exact."""
    expected = list(make(dataset_dir, num_workers=0, batch_size=32, transform=wide_crop))
    loader = make(dataset_dir, prefetch_factor=2, batch_size=32, transform=wide_crop)
    try:
        it = iter(loader)
        got = [next(it)]
        assert got[0]["wide"].numel() == 32 << 16  # 2 MiB: each slot written has 2 MiB mapped
        deadline = time.monotonic() + 60
        while loader._pool.ready() < 2 * 2 - 1:  # every other submitted batch arrived
            assert time.monotonic() < deadline, "the workers did not fill the prefetch"
            time.sleep(0.01)
        assert len(loader._pool._slots._slots) >= 4  # both workers made several slots
        for pid in loader._pool.pids():  # each lets go once its task queue is empty
            while _shared_resident(pid) > 0:
                assert time.monotonic() < deadline, (pid, _shared_resident(pid))
                time.sleep(0.01)
        got += list(it)
    finally:
        loader.close()
    assert_identical(got, expected)


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
        # Two batches each: one from each worker (round-robin), so every worker has begun its
        # loop (and let go of what it inherited) before its pipes are read.
        for loader in (first, second):  # the second's workers fork while the first pool lives
            it = iter(loader)
            next(it)
            next(it)
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


# -- start methods: spawn and forkserver ---------------------------------------------------------

START_METHODS = {
    "spawn": "spawn",
    "forkserver": "forkserver",
    "spawn-context-object": multiprocessing.get_context("spawn"),
}


@pytest.fixture(scope="module")
def fork_reference(dataset_dir):
    """Every batch of two epochs under fork, recorded bit for bit."""
    loader = make(dataset_dir)
    try:
        return [record(b) for _ in range(2) for b in loader]
    finally:
        loader.close()


@pytest.mark.parametrize("context", list(START_METHODS))
def test_spawn_and_forkserver_yield_the_batches_of_fork(dataset_dir, fork_reference, context):
    """Workers started by "spawn" or "forkserver" (by name or as a context object) produce
    exactly fork's batches, and hold only their own ends of the pool's pipes. Under forkserver
    a worker's parent is the fork server, not the training process; the workers used to exit
    at start because they took that for their training process having died (issue 22)."""
    loader = make(dataset_dir, multiprocessing_context=START_METHODS[context])
    try:
        batches = [record(b) for _ in range(2) for b in loader]
        pool = loader._pool
        for worker_id, pid in enumerate(pool.pids()):
            held = {end for end in _pipe_ends(pid) if end[0] in _pool_pipes(pool)}
            assert held == {(_inode(pool._task_queues[worker_id]._reader), "r"),
                            (_inode(pool._results._writer), "w"),
                            (_inode(pool._slot_returns[worker_id]._reader), "r")}
            parent = _ppid(pid)
            assert (parent == os.getpid()) == (context != "forkserver"), (context, parent)
    finally:
        loader.close()
    assert_same_batches(batches, fork_reference, f"{context} vs fork")


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


# -- workers die with the training process, whoever their parent is ------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_DEADLINE = 10.0

_TRAINER = """
import os, sys, threading
from shardloader import Dataset, Loader
from tests.sample_transforms import noisy_crop

if __name__ == "__main__":
    context = None if sys.argv[2] == "fork" else sys.argv[2]
    loader = Loader(Dataset(sys.argv[1]), batch_size=8, num_workers=2, transform=noisy_crop,
                    multiprocessing_context=context, persistent_workers=True)
    if sys.argv[3] == "thread":  # no parent-death signal for workers made from a thread
        starter = threading.Thread(target=lambda: next(iter(loader)))
        starter.start()
        starter.join()
    else:
        next(iter(loader))
    print("READY", *loader._pool.pids(), flush=True)
    threading.Event().wait()  # until killed
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(("context", "started_from"), [("forkserver", "main"), ("fork", "thread")])
def test_a_sigkilled_trainer_leaves_no_worker_under_forkserver(dataset_dir, tmp_path, context,
                                                               started_from):
    """SIGKILL the training process: every process below it is gone within seconds. Under
    forkserver that is the workers (grandchildren: the fork server is their parent), the fork
    server (it ends once no worker holds its "alive" pipe any more) and multiprocessing's
    resource tracker. With fork from a thread no parent-death signal is armed: the workers'
    watch of the training process alone ends them."""
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(script), dataset_dir, context, started_from],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env(),
                                start_new_session=True)
    tree: list[Proc] = []
    try:
        line = readline(proc, 180)
        assert line.startswith("READY"), line + errors.read_text()[-3000:]
        workers = [int(pid) for pid in line.split()[1:]]
        tree = descendants(proc.pid)
        assert set(workers) <= {p.pid for p in tree}, [p.describe() for p in tree]
        if context == "forkserver":
            assert {_ppid(pid) for pid in workers} != {proc.pid}  # the fork server's children
            assert any("forkserver" in p.cmdline for p in tree), [p.describe() for p in tree]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        left = wait_gone(tree, KILL_DEADLINE)
        assert not left, f"alive {KILL_DEADLINE} s after the trainer's SIGKILL: " + "; ".join(
            p.describe() for p in left)
    finally:
        kill_group(proc, tree)


_TARGET = """
import sys, time
from shardloader.runtime.liveness import this_process
me = this_process()
print(me.pid, me.start, flush=True)
time.sleep(600)
"""

_WATCHER = """
import os, sys, time
from shardloader.runtime.child_process import die_with
from shardloader.runtime.liveness import ProcessIdentity
if sys.argv[3] == "poll":
    del os.pidfd_open  # as on a kernel without pidfds: the polling fallback
die_with(ProcessIdentity(int(sys.argv[1]), int(sys.argv[2])), use_signal=False, poll_seconds=0.05)
print("WATCHING", flush=True)
time.sleep(600)
"""


def _python(code: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            text=True, env=_env())


@pytest.mark.parametrize("how", ["pidfd", "poll"])
def test_a_process_watching_one_that_is_not_its_parent_dies_with_it(how):
    """`die_with` watches the process it names, not its own parent (a forkserver worker's
    case): killed, that process is a zombie until its parent reaps it, and that already
    counts as dead."""
    target = _python(_TARGET)
    watcher = None
    try:
        pid, start = readline(target, 60).split()
        watcher = _python(_WATCHER, pid, start, how)
        assert readline(watcher, 60).strip() == "WATCHING"
        target.kill()  # not reaped yet: a zombie
        assert watcher.wait(timeout=KILL_DEADLINE) == 1
        assert target.poll() == -signal.SIGKILL  # reaped only now
    finally:
        for proc in (target, watcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.mark.parametrize("how", ["pidfd", "poll"])
def test_a_recycled_pid_is_not_taken_for_the_process_to_die_with(how):
    """A pid whose start time is not the one named is another process (the named one died and
    its pid was reused): the child exits at once instead of watching it."""
    with open(f"/proc/{os.getpid()}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    watcher = _python(_WATCHER, os.getpid(), start + 1, how)
    try:
        assert watcher.wait(timeout=60) == 1
        assert watcher.stdout is not None and watcher.stdout.read() == ""
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=30)
    same = _python(_WATCHER, os.getpid(), start, how)  # the right start time: it watches
    try:
        assert readline(same, 60).strip() == "WATCHING"
        assert same.poll() is None
    finally:
        same.kill()
        same.wait(timeout=30)


# -- torch.utils.data.get_worker_info() ----------------------------------------------------------

class WorkerInfoSamples(torch.utils.data.Dataset):
    """Each sample: what `get_worker_info()` said while it was read (None in the main process),
    and torch's seed there (the worker's own: it draws nothing, so reads are not keyed)."""

    uses_global_rng = False

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return {"i": i, "info": None}
        return {"i": i, "id": info.id, "num_workers": info.num_workers, "seed": info.seed,
                "dataset": type(info.dataset).__name__, "is_self": info.dataset is self,
                "torch_seed": torch.initial_seed(), "pid": os.getpid()}


def _as_list(items: list) -> list:
    return items


def _worker_view(samples: list[dict]) -> list[tuple]:
    """What DataLoader and the Loader must agree on: per sample, which worker read it, how
    many there are, and the dataset it saw."""
    return [(s["i"], s["id"], s["num_workers"], s["dataset"], s["is_self"]) for s in samples]


def test_get_worker_info_describes_each_worker_as_dataloader_does():
    """In a worker process `get_worker_info()` gives the worker's id, num_workers and the user's
    own dataset object, sample by sample as DataLoader gives them (batches go round-robin in
    both); its seed is the worker's: `worker_seed(seed, id)`, distinct per worker, the one
    torch's RNG was seeded with (as DataLoader's is)."""
    ours = Loader(WorkerInfoSamples(), batch_size=3, num_workers=2, seed=7, collate_fn=_as_list)
    try:
        samples = [s for batch in ours for s in batch]
    finally:
        ours.close()
    theirs = [s for batch in torch.utils.data.DataLoader(WorkerInfoSamples(), batch_size=3, num_workers=2,
                                                          collate_fn=_as_list) for s in batch]
    assert _worker_view(samples) == _worker_view(theirs)
    assert [s["id"] for s in samples] == [0, 0, 0, 1, 1, 1] * 2
    from shardloader.loader.workers.worker_process import worker_seed

    assert [s["seed"] for s in samples] == [worker_seed(7, s["id"]) for s in samples]
    assert worker_seed(7, 0) != worker_seed(7, 1) and worker_seed(7, 0) != worker_seed(8, 0)
    assert all(s["torch_seed"] == s["seed"] for s in samples + theirs)
    assert os.getpid() not in {s["pid"] for s in samples}


@pytest.mark.parametrize("workers", [{"num_workers": 0}, {"num_workers": 2, "worker_type": "thread"}])
def test_get_worker_info_is_none_in_the_training_process_and_in_threads(workers):
    loader = Loader(WorkerInfoSamples(), batch_size=3, collate_fn=_as_list, **workers)
    try:
        assert [s for batch in loader for s in batch] == [{"i": i, "info": None} for i in range(12)]
    finally:
        loader.close()
    assert torch.utils.data.get_worker_info() is None


# -- any batch structure through the slots, as DataLoader delivers it ----------------------------

Pair = collections.namedtuple("Pair", "left right")


class Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return i


def nested_containers(items: list[int]):
    t = torch.tensor(items)
    return {"a": [t * 2.5, (t.to(torch.int16).view(2, 2), {"b": t > 1})], "n": 3}


def lists_of_lists(items: list[int]):
    return [[torch.full((i % 3 + 1,), i) for i in items], [[torch.tensor(float(i))] for i in items]]


def every_dtype(items: list[int]):
    t = torch.tensor(items)
    kinds = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
             torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
             torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn]
    return {str(kind): (t * 3 + 1).to(kind) for kind in kinds}


def shapes_and_views(items: list[int]):
    base = torch.arange(24, dtype=torch.float32).view(4, 6) * items[0]
    return {"base": base, "row": base[1], "column": base[:, 2], "transposed": base.t(),
            "every_other": base[:, ::2], "as_bytes": base.view(torch.uint8), "again": base,
            "expanded": torch.tensor(items).expand(3, 4), "empty": torch.zeros(0, 3),
            "empty_t": torch.zeros(3, 0).t(), "scalar": torch.tensor(items[0] + 0.5),
            "alone_transposed": torch.arange(6.0).view(2, 3).t()}


def other_containers(items: list[int]):
    t = torch.tensor(items)
    counts = collections.defaultdict(list, {"x": [t]})
    return (Pair(t, [Pair(t + 1, "s")]), collections.OrderedDict(z=t, a=None), counts,
            np.arange(4, dtype=np.float32) * items[0], "text", 2.5, None)


def not_plain_tensors(items: list[int]):
    t = torch.tensor(items, dtype=torch.float32)
    return {"nested": torch.nested.nested_tensor([t[:1], t]), "grad": t.clone().requires_grad_(),
            "parameter": torch.nn.Parameter(t.clone()), "plain": t}


COLLATES = [nested_containers, lists_of_lists, every_dtype, shapes_and_views, other_containers,
            not_plain_tensors]


def _comparable(value):
    """`value` with nested tensors as lists of their tensors (the helper compares plain ones)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return ["nested", *value.unbind()]
    if isinstance(value, dict):
        return type(value)({k: _comparable(v) for k, v in value.items()}) if type(value) is not \
            collections.defaultdict else collections.defaultdict(value.default_factory,
                                                                {k: _comparable(v) for k, v in value.items()})
    if type(value) in (list, tuple):
        return type(value)(_comparable(v) for v in value)
    if isinstance(value, tuple):  # a namedtuple
        return type(value)(*(_comparable(v) for v in value))
    return value


def _anatomy(batch) -> list[tuple]:
    """Per tensor: path, type, strides, requires_grad, and which of the batch's storages it is on
    with its byte offset there relative to that storage's first tensor (views stay views)."""
    storages: dict[int, tuple[int, int]] = {}  # data_ptr -> (number, first byte offset)
    out = []

    def walk(path, value):
        if isinstance(value, torch.Tensor) and not value.is_nested:
            where = None
            if value.numel():
                key = value.untyped_storage().data_ptr()
                number, first = storages.setdefault(
                    key, (len(storages), value.storage_offset() * value.element_size()))
                where = (number, value.storage_offset() * value.element_size() - first)
            out.append((path, type(value).__name__, value.stride(), value.requires_grad, where))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{path}[{k!r}]", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{path}[{i}]", v)

    walk("batch", batch)
    return out


@pytest.mark.parametrize("collate_fn", COLLATES, ids=lambda f: f.__name__)
def test_custom_collate_batches_travel_as_dataloader_delivers_them(collate_fn):
    """A custom collate_fn's batches from real worker processes: the same values, types,
    dtypes, strides and shared views as DataLoader's workers deliver (torch.nested tensors
    used to crash the slots; they, and what else the slots do not carry, travel pickled)."""
    theirs = list(torch.utils.data.DataLoader(Indices(), batch_size=4, num_workers=2,
                                              collate_fn=collate_fn))
    loader = Loader(Indices(), batch_size=4, num_workers=2, collate_fn=collate_fn)
    try:
        ours = list(loader)
    finally:
        loader.close()
    assert len(ours) == len(theirs) == 3
    for i, (got, want) in enumerate(zip(ours, theirs)):
        assert_identical(_comparable(got), _comparable(want), f"batch {i}")
        assert _anatomy(got) == _anatomy(want), f"batch {i}"


def unpicklable_second_batch(items: list[int]):
    batch = {"t": torch.tensor(items) * 1.5}
    if items[0] == 4:
        batch["f"] = lambda: None
    return batch


def test_a_batch_that_cannot_travel_fails_alone():
    """A batch holding something that does not pickle (a lambda) raises for that batch, as the
    dataset's own errors do, and the next batch still comes, exact: the slot the failed batch
    was written to (made for it: the first batch's was still lent) goes with the next one."""
    loader = Loader(Indices(), batch_size=4, num_workers=1, collate_fn=unpicklable_second_batch)
    try:
        it = iter(loader)
        first = next(it)
        with pytest.raises(Exception, match="pickle"):
            next(it)
        third = next(it)
        with pytest.raises(StopIteration):
            next(it)
    finally:
        loader.close()
    assert_identical(first, {"t": torch.arange(4) * 1.5})
    assert_identical(third, {"t": torch.arange(8, 12) * 1.5})


def test_what_spawn_cannot_pickle_is_refused_with_what_to_do():
    """Under spawn the producer is pickled to each worker; a lambda collate_fn raises pickle's
    own error (DataLoader's), with a note saying what must be importable."""
    loader = Loader(Indices(), batch_size=4, num_workers=1, multiprocessing_context="spawn",
                    collate_fn=lambda items: items)
    try:
        with pytest.raises(Exception, match="pickle") as raised:
            next(iter(loader))
        assert any("define them at module level" in note for note in raised.value.__notes__)
    finally:
        loader.close()
