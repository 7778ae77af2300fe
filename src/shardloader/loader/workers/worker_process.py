"""What a worker process does before its first task (the loop itself is `pool._worker_main`).

The same under every start method ("fork", "spawn", "forkserver"):

- First (`pool._worker_main` calls it), die with the training process, however it ends
  (`shardloader.runtime.child_process.die_with`: the training process is watched itself,
  since under forkserver a worker's parent is the fork server).
- Then what DataLoader's workers do: `torch.utils.data.get_worker_info()` describes this
  worker (`set_worker_info`), the global RNGs are seeded per worker, torch uses one thread;
  and ours: a lower CPU priority, Ctrl-C left to the training process.
- Each step is reported as it begins (`StartProgress`, a shared byte per worker), and the last
  one says "started": the pool waits a bounded time for that (`pool.WORKER_START_SECONDS`), and
  a worker that does not get there is an error that names the step it is stuck in.

Thread pools and fork. A forked child inherits a library's thread pool as data only: its
threads do not exist in the child. torch's (OpenMP) and the BLAS pools notice and start anew,
but OpenCV's ("pthreads" backend) does not: once it has run threads in the training process,
`cv2.setNumThreads(1)` in a forked child waits forever for threads that are not there. So the
training process sets OpenCV to one thread while it forks its workers, and restores its own
setting once they are forked (`fork_safe_thread_pools`): the children inherit a pool with no
threads, which they may reconfigure.

`get_worker_info()` is None in the training process and in thread workers (`worker_type=
"thread"`), as for DataLoader with `num_workers=0`: threads share the process, and the global
it reads cannot tell one thread from another.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardloader.loader.batches import BatchProducer
from shardloader.order.keys import derive_key
from shardloader.runtime.liveness import ProcessIdentity
from shardloader.runtime.startup import collect_in_forked_worker

#: Keeps worker seeds apart from every other use of the Loader's seed.
_WORKER_SEED_BASE = 0x5EED_0F_3011
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class WorkerStart:
    """What one worker process is told about itself (it travels to the worker: picklable)."""

    worker_id: int
    num_workers: int
    training: ProcessIdentity  # the process to die with
    use_signal: bool  # whether the parent-death signal may be armed (see child_process)
    dataset: Any  # the user's dataset: `get_worker_info().dataset`


def worker_seed(seed: int, worker_id: int) -> int:
    """This worker's `get_worker_info().seed`: a non-negative 63-bit int from the Loader's seed
    and the worker id (DataLoader's is `base_seed + worker_id`, base_seed drawn per epoch).

    Not used for the order or for augmentation: those are keyed per sample (invariants I1 and
    I3), so batches never depend on which worker made them. It seeds the worker's global RNGs
    (`random`, `numpy.random`, torch's), as DataLoader seeds them, for what a dataset draws
    outside a sample's read (in `worker_init_fn`, say): distinct per worker, the same every run."""
    return derive_key(_WORKER_SEED_BASE, seed, worker_id) & _SEED_MASK


#: What a worker does while it starts, in order (name, in words): what `StartProgress`
#: reports. "start_method" is the start method's own work, before any of ours runs (its words
#: depend on the method: `_BEING_STARTED`).
START_STEPS: tuple[tuple[str, str], ...] = (
    ("start_method", "being started by its start method"),
    ("watch", "arming its watch of the training process (die_with)"),
    ("close_ends", "closing the pipe ends it inherited"),
    ("setup", "collecting garbage, seeding its RNGs and setting get_worker_info()"),
    ("torch_threads", "setting torch to one thread (torch.set_num_threads(1))"),
    ("priority", "lowering its CPU priority"),
    ("opencv_threads", "setting OpenCV to one thread (cv2.setNumThreads(1))"),
    ("slots", "preparing its batch slots"),
)
_STEP_NUMBER = {name: number for number, (name, _) in enumerate(START_STEPS)}
_BEING_STARTED = {
    "fork": "in the fork handlers (os.register_at_fork's, multiprocessing's after-fork hooks)",
    "spawn": "importing and unpickling its dataset, transform and collate_fn (spawn)",
    "forkserver": "importing and unpickling its dataset, transform and collate_fn (forkserver)",
}
STARTED = len(START_STEPS)


class StartProgress:
    """Which start-up step each worker is in: one byte per worker in shared memory, written by
    the worker as it begins a step and read by the pool (and, once started, which task it
    works on: a dead worker's error names the batch it died on). The worker's "started" is the byte
    reaching `STARTED`; shared memory, not a message, so that the pool can also tell where a
    worker is stuck (a message from a stuck worker never comes)."""

    def __init__(self, ctx: Any, num_workers: int) -> None:
        self._steps = ctx.RawArray("b", num_workers)  # zeros: step 0, being started
        self._tasks = ctx.RawArray("q", num_workers)  # the task id each works on (0: none yet)
        self._method = ctx.get_start_method()

    def begin(self, worker_id: int, step: str) -> None:
        """In the worker: it begins `step` (a name in `START_STEPS`)."""
        self._steps[worker_id] = _STEP_NUMBER[step]

    def finish(self, worker_id: int) -> None:
        """In the worker: it has started (ready for its first task)."""
        self._steps[worker_id] = STARTED

    def working_on(self, worker_id: int, task_id: int) -> None:
        """In the worker: it begins producing task `task_id` (named if it dies on it)."""
        self._tasks[worker_id] = task_id

    def task(self, worker_id: int) -> int:
        """The task the worker began last (0: none yet)."""
        return self._tasks[worker_id]

    def started(self, worker_id: int) -> bool:
        return self._steps[worker_id] == STARTED

    def doing(self, worker_id: int) -> str:
        """What the worker is doing, in words (for an error message)."""
        step = self._steps[worker_id]
        if step >= STARTED:
            return "started"
        return _BEING_STARTED.get(self._method, START_STEPS[0][1]) if step == 0 else START_STEPS[step][1]


@contextlib.contextmanager
def fork_safe_thread_pools() -> Iterator[None]:
    """In the training process, around forking workers: OpenCV at one thread meanwhile, its own
    setting restored afterwards (see the module doc). Only where the training process has
    imported OpenCV: otherwise there is no pool to inherit, and nothing is imported."""
    cv2 = sys.modules.get("cv2")
    threads = None
    if cv2 is not None and hasattr(cv2, "setNumThreads"):
        threads = cv2.getNumThreads()
        cv2.setNumThreads(1)  # ends the pool's threads: the children inherit none
    try:
        yield
    finally:
        if threads is not None:
            cv2.setNumThreads(threads)


def begin_worker(start: WorkerStart, producer: BatchProducer, progress: StartProgress) -> None:
    """What a worker process does before its first task, once it watches the training process
    (`die_with(start.training)`, which the worker calls first of all). Each step is reported to
    `progress` as it begins."""
    worker_id = start.worker_id
    progress.begin(worker_id, "setup")
    collect_in_forked_worker()
    # Ctrl-C goes to the main process, which shuts workers down; workers must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    producer.report_cache_counters = True  # this process's cache counters are its batches'
    producer.worker_id = start.worker_id  # runs worker_init_fn(worker_id) before the first batch
    seed = worker_seed(producer.seed, start.worker_id)
    random.seed(seed)
    np.random.seed([seed & 0xFFFF_FFFF, seed >> 32])
    torch.manual_seed(seed)
    set_worker_info(start, seed)
    # Workers parallelise; intra-op pools would oversubscribe the cores (torch's also spins
    # for milliseconds per op on a busy machine). DataLoader's workers do the same for torch.
    # Safe after fork whatever the training process did with torch's pool (tests/
    # test_worker_startup.py); OpenCV's is made safe by `fork_safe_thread_pools`.
    progress.begin(worker_id, "torch_threads")
    torch.set_num_threads(1)
    progress.begin(worker_id, "priority")
    _lower_priority()
    progress.begin(worker_id, "opencv_threads")
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:  # pragma: no cover - opencv is a dependency
        pass


def set_worker_info(start: WorkerStart, seed: int) -> None:
    """Make `torch.utils.data.get_worker_info()` describe this worker: `id`, `num_workers`,
    `seed` (`worker_seed`) and `dataset` (the user's dataset, this process's copy).

    torch has no public API for this: `get_worker_info()` returns the module global
    `_worker_info` of `torch.utils.data._utils.worker`, which DataLoader's own worker loop
    assigns first thing. Datasets rely on it (one file handle per worker, a shard per worker),
    so we assign it the same way, with torch's own `WorkerInfo`."""
    from torch.utils.data._utils import worker as torch_worker

    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=start.worker_id, num_workers=start.num_workers, seed=seed, dataset=start.dataset)


_WORKER_NICE = 5


def _lower_priority() -> None:
    """Give the training process precedence over its workers (nice +5).

    Workers are there to run ahead of the training loop. When they are ahead, handing one a
    task wakes it, and on a machine whose cores the workers fill the kernel preempts the
    training thread in favour of the woken worker: measured on 2 cores with the consumer at
    80% of the loader's capacity, next() then took 5 ms per batch instead of 1-2 ms. At a lower
    priority the workers still get every core the training process leaves idle.

    And SCHED_BATCH (Linux): the kernel never lets a woken batch task preempt the running
    one, which is what a worker woken by its next task did to the training thread inside the
    pipe write of `submit` even at nice +5 (measured, same setting: the write took 0.8 ms of a
    0.9 ms next() on average; a CPU-bound worker loses nothing by it). Only this process's
    policy changes; an unprivileged process may always choose it.
    """
    try:
        os.nice(_WORKER_NICE)
    except OSError:  # not permitted here: run at the inherited priority
        pass
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is not None:
        try:
            os.sched_setscheduler(0, batch, os.sched_param(0))
        except OSError:  # not permitted, or not Linux: keep the normal policy
            pass
