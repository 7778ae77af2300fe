"""Worker pools that run BatchProducer tasks and hand results back in submission order.

Three kinds, same interface (`submit(task)`, `get(task_id)`, `ready()`, `close()`):

- `InlinePool` (num_workers=0) and `ThreadPool`, in the training process
  (`shardloader.loader.workers.inprocess`);
- `ProcessPool`: worker processes (fork by default, like DataLoader on Linux; "spawn" and
  "forkserver" too). Batches come back through a queue; their tensors travel through
  shared-memory slots that each worker reuses (`shardloader.loader.workers.slots`). A worker
  that dies is detected while waiting and raised as WorkerError naming it — never a hang.
  Workers die with the training process, by any signal, under every start method, and hold
  only their own ends of the pipes (`shardloader.loader.workers.worker_process`,
  `_close_inherited_ends`). A worker that has not finished starting within
  `WORKER_START_SECONDS` is a WorkerError naming the start-up step it is stuck in.

`close()` is idempotent and bounded (`CLOSE_SECONDS` by default): what does not stop in time
is terminated, then killed; it never waits on a thread or a process without a deadline.

Results are keyed by task id and handed out in the order the loader asks for them, so output
never depends on which worker finished first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import pickle
import signal
import threading
import time
from typing import Any

import torch.multiprocessing as torch_mp

from shardloader.errors import WorkerError
from shardloader.loader.batches import BatchProducer, BatchTask, BatchTimings
from shardloader.loader.failures import (
    BatchFailure,
    FailureRecord,
    rebuild,
    record_in_worker,
)
from shardloader.loader.workers.frames import ATOMIC_BYTES, frame
from shardloader.loader.workers.inprocess import InlinePool, ThreadPool
from shardloader.loader.workers.lifetime import _LIVE_POOLS, _POOL_THREADS, CLOSE_SECONDS
from shardloader.loader.workers.slots import LEND_PER_WORKER, SlotReader, SlotWriter
from shardloader.loader.workers.worker_process import (
    StartProgress,
    WorkerStart,
    begin_worker,
    fork_safe_thread_pools,
)
from shardloader.runtime.child_process import die_with, start_children
from shardloader.runtime.liveness import this_process

#: A batch (or a `BatchFailure` in its place: see `shardloader.loader.failures`) and its timings.
Result = tuple[Any, BatchTimings]
_POLL_SECONDS = 0.2
#: What pickling a worker's arguments raises for what does not pickle (a lambda, a local class).
_PICKLING_ERRORS = (pickle.PicklingError, AttributeError, TypeError)
#: How long a worker process may take to start (from the pool's creation until it is ready for
#: its first task) before the loader gives up on it with a WorkerError. Generous: under "spawn"
#: a worker imports torch and the dataset's modules first, seconds on a loaded machine.
WORKER_START_SECONDS = 60.0


def _worker_main(start: WorkerStart, producer: BatchProducer, tasks: Any, results: Any,
                 returned_slots: Any, progress: StartProgress) -> None:
    # First: die with the training process, however it ends; then let go of what it must not
    # hold, before anything slow (imports) runs. See worker_process. Each step is reported
    # to `progress` (the pool's start-up bound names the one a worker is stuck in).
    worker_id = start.worker_id
    progress.begin(worker_id, "watch")
    die_with(start.training, use_signal=start.use_signal)
    progress.begin(worker_id, "close_ends")
    _close_inherited_ends(tasks, results, returned_slots)
    begin_worker(start, producer, progress)
    progress.begin(worker_id, "slots")
    writer = SlotWriter(returned_slots)
    producer.allocate = writer.allocate  # the direct batch path builds images in a slot
    producer.allocate_many = writer.allocate_many  # the general path collates into a slot
    progress.finish(worker_id)
    while True:
        try:
            if tasks.empty():  # nothing to do until the loader asks: see slots (`idle`)
                writer.idle()
            task = tasks.get()
        except (EOFError, OSError):  # every write end is closed: the training process is gone
            return
        if task is None:
            return
        task = BatchTask(*task)  # sent as a tuple: see `_task_frame`
        progress.working_on(worker_id, task.task_id)  # named if this worker dies on it
        try:
            batch, timings = producer(task)
            packed = writer.pack(batch)
        except Exception as e:  # noqa: BLE001 - the dataset's error, raised for this batch
            results.put((worker_id, task.task_id, False,
                         record_in_worker(e, worker_id, task.epoch, task.step)))
            continue
        try:
            results.put((worker_id, task.task_id, True, (packed, timings)))
        except Exception as e:  # noqa: BLE001 - a batch that does not pickle (nothing was sent)
            writer.unsent(packed)
            results.put((worker_id, task.task_id, False,
                         record_in_worker(e, worker_id, task.epoch, task.step)))


def _close_inherited_ends(tasks: Any, results: Any, returned_slots: Any) -> None:
    """In a worker, close every pipe end it was given or inherited but must not hold.

    A forked child holds a copy of each descriptor its parent had open: the write end of its
    own task queue, the other workers' queues, the read end of the result queue, and the pipes
    of any other live pool. As long as a worker holds the write end of its own task queue, its
    read never sees end-of-file when the training process dies, and a worker of another pool
    keeps this pool's pipes alive after this pool's workers are gone. Under "spawn" and
    "forkserver" a worker inherits none of those (the registry is empty there), but each queue
    it is passed arrives with both its ends. Kept: the read end of `tasks`, the write end of
    `results`, the read end of `returned_slots`.
    """
    keep = {id(tasks._reader), id(results._writer), id(returned_slots._reader)}
    conns = [tasks._writer, results._reader, returned_slots._writer]
    for pool in list(_LIVE_POOLS):
        conns += pool._connections()
    for conn in conns:
        if id(conn) not in keep:
            try:
                conn.close()
            except OSError:
                pass


def _task_frame(task: BatchTask) -> bytes:
    """`task` as one message for the worker's task queue (see `shardloader.loader.workers.frames`):
    a tuple of its fields, which unpickles faster than the dataclass."""
    return frame(_task_values(task))


#: A BatchTask's field values, in field order: what travels (the worker rebuilds the task
#: with `BatchTask(*values)`).
_task_values = operator.attrgetter(*(f.name for f in dataclasses.fields(BatchTask)))


class ProcessPool:
    """Worker processes; tasks are dealt round-robin, results reordered by task id.

    A receiver thread takes results off the queue as they arrive and unpacks their batches
    (views of the workers' slots), so that `get` usually finds its batch ready: the caller's
    thread (the training loop) does not pay for unpickling inside next(). Slots of batches the
    training loop has dropped go back to their workers from `get` and, while the loop does not
    ask for batches, from the receiver.

    Workers are started on a thread that lasts as long as the training process
    (`shardloader.runtime.child_process.start_children`), so that the kernel kills them when it
    dies whichever thread made the pool; under fork, with the training process's thread pools
    made safe to inherit (`worker_process.fork_safe_thread_pools`). Each worker reports its
    start-up steps (`worker_process.StartProgress`); `get` gives up on one that has not
    started within `WORKER_START_SECONDS`, naming the step.
    """

    def __init__(self, producer: BatchProducer, num_workers: int, *, context: str | None = None,
                 timeout: float | None = None, prefetch_factor: int = 2,
                 worker_dataset: Any = None) -> None:
        """`context`: the start method's name (None: "fork"). Under "spawn" and "forkserver"
        the producer (its dataset, transform, collate_fn) is pickled to each worker, so they
        must be importable, as DataLoader needs them. `worker_dataset` is what
        `get_worker_info().dataset` is in a worker (the user's dataset; None: the producer's)."""
        ctx = torch_mp.get_context(context or "fork")
        if ctx.get_start_method() == "fork":
            producer.warm_up()  # workers inherit the imports instead of each paying for them
        if worker_dataset is None:
            worker_dataset = producer.dataset
        self.timeout = timeout
        self._closed = False
        # A SimpleQueue: each worker writes its (small) result message itself, under the
        # queue's lock. multiprocessing.Queue would hand it to a feeder thread per worker, a
        # thread switch per batch that cost the worker ~150 us of CPU per batch (measured on
        # the 2-core machine: pack + put 166-200 us per batch, the feeder 50 us more).
        self._results = ctx.SimpleQueue()
        self._task_queues = [ctx.SimpleQueue() for _ in range(num_workers)]
        self._slot_returns = [ctx.SimpleQueue() for _ in range(num_workers)]
        # Lent per worker: its batches waiting in `_done` (prefetch_factor), the one the
        # training loop holds, and one dropped but not yet sent back.
        self._slots = SlotReader(self._slot_returns, lend_per_worker=max(LEND_PER_WORKER, prefetch_factor + 2))
        self._workers = []
        self._next_worker = 0
        self._assigned: dict[int, int] = {}  # task id -> worker id
        self._batches: dict[int, str] = {}  # task id -> "batch s of epoch e", for errors
        self._done: dict[int, tuple[bool, Any]] = {}
        self._cond = threading.Condition()
        self._receiver_error: str | None = None
        self._receiver = threading.Thread(target=self._receive, name="shardloader-receiver",
                                          daemon=True)
        self._start_method = ctx.get_start_method()
        self._progress = StartProgress(ctx, num_workers)
        self._start_seconds = WORKER_START_SECONDS
        self._start_deadline = time.monotonic() + self._start_seconds
        self._all_started = False
        _LIVE_POOLS.add(self)  # before forking: each worker closes what it must not hold
        try:
            try:
                start_children(lambda: self._start_workers(ctx, producer, num_workers, worker_dataset),
                               timeout=self._start_seconds)
            except TimeoutError as e:
                raise WorkerError(f"starting {num_workers} worker processes "
                                  f"({self._start_method}) took longer than "
                                  f"{self._start_seconds} s") from e
        except BaseException as e:
            self.close()
            if ctx.get_start_method() != "fork" and isinstance(e, _PICKLING_ERRORS):
                e.add_note(f"shardloader: under multiprocessing_context={ctx.get_start_method()!r} "
                           f"the dataset, transform, collate_fn and worker_init_fn are pickled to "
                           f"each worker: define them at module level (not lambdas or local "
                           f"functions), in a module the workers can import")
            raise
        _POOL_THREADS.add(self._receiver)
        self._receiver.start()

    def _start_workers(self, ctx: Any, producer: BatchProducer, num_workers: int,
                       worker_dataset: Any) -> None:
        """Start the worker processes (on the thread `start_children` picks)."""
        training = this_process()
        forks = self._start_method == "fork"
        with fork_safe_thread_pools() if forks else contextlib.nullcontext():
            for worker_id, tasks in enumerate(self._task_queues):
                if self._closed:  # the caller gave up waiting (see start_children)
                    return
                # use_signal: started on a lasting thread (see child_process.start_children)
                start = WorkerStart(worker_id, num_workers, training, True, worker_dataset)
                process = ctx.Process(
                    target=_worker_main,
                    args=(start, producer, tasks, self._results, self._slot_returns[worker_id],
                          self._progress),
                    name=f"shardloader-worker-{worker_id}",
                    daemon=True,
                )
                process.start()
                self._workers.append(process)
                if self._closed:  # closed meanwhile: close() may have missed this one
                    process.kill()

    def submit(self, task: BatchTask, worker: int | None = None) -> None:
        """Send `task` to `worker` (an iterable dataset's tasks name theirs), or to the next
        worker in turn."""
        worker_id = self._next_worker if worker is None else worker
        self._next_worker = (worker_id + 1) % len(self._workers)
        with self._cond:
            self._assigned[task.task_id] = worker_id
            self._batches[task.task_id] = f"batch {task.step} of epoch {task.epoch}"
        message = _task_frame(task)
        if len(message) <= ATOMIC_BYTES:  # one atomic write (see `shardloader.loader.workers.frames`)
            os.write(self._task_queues[worker_id]._writer.fileno(), message)
        else:  # a task that carries its samples and many of them: the queue's own framing
            self._task_queues[worker_id].put(_task_values(task))

    def _receive(self) -> None:
        """The receiver thread: results into `_done`, slots of dropped batches given back."""
        while not self._closed:
            self._slots.give_back_freed()  # batches the training loop has dropped meanwhile
            try:
                if not self._results._reader.poll(_POLL_SECONDS):
                    continue
                message = self._results.get()
            except (EOFError, OSError, ValueError):  # the queue was closed under us
                return
            except Exception as e:  # noqa: BLE001 - e.g. a result that does not unpickle
                with self._cond:
                    self._receiver_error = f"{type(e).__name__}: {e}"
                    self._cond.notify_all()
                return
            if message is None:  # close() wakes us
                return
            worker_id, task_id, ok, payload = message
            with self._cond:
                wanted = task_id in self._assigned  # else: a discarded task's
            if ok:
                packed, timings = payload
                try:
                    payload = (self._slots.unpack(worker_id, packed, wanted), timings)
                except Exception as e:  # noqa: BLE001 - reported to whoever waits for it
                    ok, payload = False, f"receiving its batch failed: {type(e).__name__}: {e}"
            elif isinstance(payload, FailureRecord):  # the dataset's error: this batch only
                ok, payload = True, (BatchFailure(rebuild(payload)), BatchTimings())
            with self._cond:
                if wanted and task_id in self._assigned:
                    self._done[task_id] = (ok, payload)
                    self._cond.notify_all()

    def _check_alive(self, task_id: int) -> None:
        for worker_id, process in enumerate(self._workers):
            if process.exitcode is not None:
                code = process.exitcode
                how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                during = ("" if self._progress.started(worker_id) else
                          f" while starting ({self._progress.doing(worker_id)})")
                raise WorkerError(
                    f"worker {worker_id} (pid {process.pid}) exited unexpectedly, {how}{during}, "
                    f"while reading {self._reading(worker_id)}; the loader cannot continue this "
                    f"iteration (batch task {task_id} was awaited)"
                )

    def _reading(self, worker_id: int) -> str:
        """The batch `worker_id` was producing last (what it died reading), from the task id
        it wrote to shared memory before beginning it (`StartProgress.working_on`)."""
        task_id = self._progress.task(worker_id)
        if task_id == 0:
            return "no batch yet"
        return self._batches.get(task_id, f"batch task {task_id}")

    def _check_started(self, task_id: int) -> None:
        """A WorkerError for the first worker that has not started by the start-up deadline."""
        if self._all_started:
            return
        if all(self._progress.started(i) for i in range(len(self._workers))):
            self._all_started = True
            return
        if time.monotonic() <= self._start_deadline:
            return
        for worker_id, process in enumerate(self._workers):
            if not self._progress.started(worker_id):
                raise WorkerError(
                    f"worker {worker_id} (pid {process.pid}, {self._start_method}) did not start "
                    f"within {self._start_seconds} s: it is still "
                    f"{self._progress.doing(worker_id)}; batch task {task_id} cannot be made")

    def _not_started(self, worker_id: int | None) -> str:
        """For a timeout's message: what the task's worker is doing when it has not started."""
        if worker_id is None or self._progress.started(worker_id):
            return ""
        return (f"; its worker {worker_id} has not started: it is still "
                f"{self._progress.doing(worker_id)}")

    def get(self, task_id: int) -> Result:
        # Slots of the batches the training loop dropped since the last call go home now,
        # before it waits: their workers reuse them for their next batch (see SlotReader).
        self._slots.give_back_freed()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            while task_id not in self._done:
                if task_id not in self._assigned:  # discarded (a new epoch) or closed meanwhile
                    raise WorkerError(f"batch task {task_id} was discarded while it was awaited")
                if self._receiver_error is not None:
                    raise WorkerError(f"receiving batches from the workers failed while batch "
                                      f"task {task_id} was pending: {self._receiver_error}")
                self._check_alive(task_id)
                self._check_started(task_id)
                if deadline is not None and time.monotonic() > deadline:
                    worker_id = self._assigned[task_id]
                    raise WorkerError(
                        f"Loader timed out after {self.timeout} seconds waiting for "
                        f"{self._batches.get(task_id, 'a batch')} from worker {worker_id} (pid "
                        f"{self._workers[worker_id].pid}, batch task {task_id}; timeout="
                        f"{self.timeout}){self._not_started(worker_id)}")
                self._cond.wait(_POLL_SECONDS)
            ok, payload = self._done.pop(task_id)
            del self._assigned[task_id]
            self._batches.pop(task_id, None)
        if not ok:
            raise WorkerError(f"worker process failed on batch task {task_id}: {payload}")
        return payload

    def ready(self) -> int:
        return len(self._done)  # one atomic read (GIL): no lock on the training thread

    def discard_pending(self) -> None:
        with self._cond:
            self._assigned.clear()
            self._batches.clear()
            self._done.clear()

    def _connections(self) -> list[Any]:
        """Every pipe end this pool's queues hold in this process."""
        conns = [self._results._reader, self._results._writer]
        for q in (*self._task_queues, *self._slot_returns):
            conns += [q._reader, q._writer]
        return conns

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop the workers within about `timeout` seconds; idempotent, never unbounded.

        Asks each worker to stop (a None task), waits until the deadline, then terminates and
        finally kills what is left. Safe at interpreter exit: it starts no thread, and the
        receiver thread notices `_closed` at its next poll."""
        if self._closed:
            return
        self._closed = True
        _LIVE_POOLS.discard(self)
        deadline = time.monotonic() + max(0.0, timeout)
        for tasks, process in zip(self._task_queues, self._workers):
            if process.is_alive():  # a dead worker's pipe may be full: never block on it
                try:
                    tasks.put(None)
                except (OSError, ValueError):
                    pass
        _join_all(self._workers, deadline)
        for sig_method, grace in (("terminate", 1.0), ("kill", 1.0)):
            alive = [p for p in self._workers if p.is_alive()]
            if not alive:
                break
            for process in alive:
                getattr(process, sig_method)()
            _join_all(alive, time.monotonic() + grace)
        if self._receiver is not threading.current_thread() and self._receiver.is_alive():
            self._receiver.join(max(0.0, min(2 * _POLL_SECONDS, deadline - time.monotonic())) or 0.01)
        self._slots.clear()  # before the pipes close: no slot is sent back from now on
        self._results.close()
        for q in (*self._task_queues, *self._slot_returns):
            try:
                q.close()
            except (OSError, ValueError):
                pass
        with self._cond:
            self._done.clear()
            self._assigned.clear()
            self._cond.notify_all()

    def abandon(self) -> None:
        """Stop without waiting for anything (for `__del__` and interpreter exit from a state
        where waiting is unsafe): workers are killed; the pipes close with this object."""
        if self._closed:
            return
        self._closed = True
        _LIVE_POOLS.discard(self)
        for process in self._workers:
            try:
                if process.is_alive():
                    process.kill()
            except (OSError, ValueError, AttributeError):
                pass

    def pids(self) -> list[int]:
        return [p.pid for p in self._workers if p.pid is not None]


def _join_all(processes: list[Any], deadline: float) -> None:
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def make_pool(producer: BatchProducer, num_workers: int, worker_type: str, *,
              context: str | None = None, timeout: float | None = None, prefetch_factor: int = 2,
              worker_dataset: Any = None) -> Any:
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if num_workers == 0:
        return InlinePool(producer)
    if worker_type == "thread":
        return ThreadPool(producer, num_workers, timeout=timeout)
    if worker_type == "process":
        return ProcessPool(producer, num_workers, context=context, timeout=timeout,
                           prefetch_factor=prefetch_factor, worker_dataset=worker_dataset)
    raise ValueError(f"worker_type must be 'process' or 'thread', got {worker_type!r}")


