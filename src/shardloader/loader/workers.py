"""Worker pools that run BatchProducer tasks and hand results back in submission order.

Three kinds, same interface (`submit(task)`, `get(task_id)`, `ready()`, `close()`):

- `InlinePool` (num_workers=0): produces in the caller's thread when asked.
- `ThreadPool`: threads; right when decode releases the GIL (simplejpeg, OpenCV do).
- `ProcessPool`: worker processes (fork by default, like DataLoader on Linux). Batches come
  back through a queue; their tensors travel through shared-memory slots that each worker
  reuses (`shardloader.loader.slots`). A worker that dies is detected while waiting and raised
  as WorkerError naming it — never a hang.

Results are keyed by task id and handed out in the order the loader asks for them, so output
never depends on which worker finished first.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from shardloader.errors import WorkerError
from shardloader.loader.batches import BatchProducer, BatchTask, BatchTimings
from shardloader.loader.slots import SlotReader, SlotWriter

Result = tuple[Any, BatchTimings]
_POLL_SECONDS = 0.2


class InlinePool:
    """No workers: each batch is produced when the caller asks for it."""

    def __init__(self, producer: BatchProducer) -> None:
        self.producer = producer
        self._tasks: dict[int, BatchTask] = {}

    def submit(self, task: BatchTask) -> None:
        self._tasks[task.task_id] = task

    def get(self, task_id: int) -> Result:
        return self.producer(self._tasks.pop(task_id))

    def ready(self) -> int:
        return 0

    def discard_pending(self) -> None:
        self._tasks.clear()

    def close(self) -> None:
        self._tasks.clear()


class ThreadPool:
    """Worker threads sharing the process (and its open shard readers)."""

    def __init__(self, producer: BatchProducer, num_workers: int) -> None:
        self.producer = producer
        self._executor = concurrent.futures.ThreadPoolExecutor(
            num_workers, thread_name_prefix="shardloader")
        self._futures: dict[int, concurrent.futures.Future[Result]] = {}

    def submit(self, task: BatchTask) -> None:
        self._futures[task.task_id] = self._executor.submit(self.producer, task)

    def get(self, task_id: int) -> Result:
        future = self._futures.pop(task_id)
        try:
            return future.result()
        except Exception as e:
            raise WorkerError(f"worker thread failed on batch task {task_id}: {e}") from e

    def ready(self) -> int:
        return sum(f.done() for f in self._futures.values())

    def discard_pending(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()

    def close(self) -> None:
        self.discard_pending()
        self._executor.shutdown(wait=True, cancel_futures=True)


def _worker_main(worker_id: int, producer: BatchProducer, tasks: Any, results: Any,
                 returned_slots: Any) -> None:
    # Ctrl-C goes to the main process, which shuts workers down; workers must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    producer.report_cache_counters = True  # this process's cache counters are its batches'
    producer.worker_id = worker_id  # runs worker_init_fn(worker_id) before the first batch
    # Workers parallelise; intra-op pools would oversubscribe the cores (torch's also spins
    # for milliseconds per op on a busy machine). DataLoader's workers do the same for torch.
    torch.set_num_threads(1)
    _lower_priority()
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:  # pragma: no cover - opencv is a dependency
        pass
    writer = SlotWriter(returned_slots)
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            batch, timings = producer(task)
            results.put((worker_id, task.task_id, True, (writer.pack(batch), timings)))
        except Exception as e:  # noqa: BLE001 - every failure is reported to the caller
            message = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            results.put((worker_id, task.task_id, False, message))


_WORKER_NICE = 5


def _lower_priority() -> None:
    """Give the training process precedence over its workers (nice +5).

    Workers are there to run ahead of the training loop. When they are ahead, handing one a
    task wakes it, and on a machine whose cores the workers fill the kernel preempts the
    training thread in favour of the woken worker: measured on 2 cores with the consumer at
    80% of the loader's capacity, next() then took 5 ms per batch instead of 1-2 ms. At a lower
    priority the workers still get every core the training process leaves idle.
    """
    try:
        os.nice(_WORKER_NICE)
    except OSError:  # not permitted here: run at the inherited priority
        pass


class ProcessPool:
    """Worker processes; tasks are dealt round-robin, results reordered by task id.

    A receiver thread takes results off the queue as they arrive and copies their batches out
    of the workers' slots, so that `get` usually finds its batch ready: the caller's thread
    (the training loop) does not pay for unpickling and copying inside next().
    """

    def __init__(self, producer: BatchProducer, num_workers: int, *, context: str | None = None,
                 timeout: float | None = None) -> None:
        ctx = torch_mp.get_context(context or "fork")
        if ctx.get_start_method() == "fork":
            producer.warm_up()  # workers inherit the imports instead of each paying for them
        self.timeout = timeout
        self._results = ctx.Queue()
        self._task_queues = [ctx.SimpleQueue() for _ in range(num_workers)]
        self._slot_returns = [ctx.SimpleQueue() for _ in range(num_workers)]
        self._slots = SlotReader(self._slot_returns)
        self._workers = []
        for worker_id, tasks in enumerate(self._task_queues):
            process = ctx.Process(
                target=_worker_main,
                args=(worker_id, producer, tasks, self._results, self._slot_returns[worker_id]),
                name=f"shardloader-worker-{worker_id}",
                daemon=True,
            )
            process.start()
            self._workers.append(process)
        self._next_worker = 0
        self._assigned: dict[int, int] = {}  # task id -> worker id
        self._done: dict[int, tuple[bool, Any]] = {}
        self._cond = threading.Condition()
        self._receiver_error: str | None = None
        self._closed = False
        self._receiver = threading.Thread(target=self._receive, name="shardloader-receiver",
                                          daemon=True)
        self._receiver.start()

    def submit(self, task: BatchTask) -> None:
        worker_id = self._next_worker
        self._next_worker = (self._next_worker + 1) % len(self._workers)
        with self._cond:
            self._assigned[task.task_id] = worker_id
        self._task_queues[worker_id].put(task)

    def _receive(self) -> None:
        """The receiver thread: results into `_done`, batches copied out of their slots."""
        while not self._closed:
            try:
                message = self._results.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
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
            with self._cond:
                if wanted and task_id in self._assigned:
                    self._done[task_id] = (ok, payload)
                    self._cond.notify_all()

    def _check_alive(self, task_id: int) -> None:
        for worker_id, process in enumerate(self._workers):
            if process.exitcode is not None:
                code = process.exitcode
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                raise WorkerError(
                    f"worker {worker_id} (pid {process.pid}) died with {how} while batch task "
                    f"{task_id} was pending; the loader cannot continue this iteration"
                )

    def get(self, task_id: int) -> Result:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            while task_id not in self._done:
                if self._receiver_error is not None:
                    raise WorkerError(f"receiving batches from the workers failed while batch "
                                      f"task {task_id} was pending: {self._receiver_error}")
                self._check_alive(task_id)
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerError(f"batch task {task_id} took longer than the {self.timeout} s timeout")
                self._cond.wait(_POLL_SECONDS)
            ok, payload = self._done.pop(task_id)
            del self._assigned[task_id]
        if not ok:
            raise WorkerError(f"worker process failed on batch task {task_id}: {payload}")
        return payload

    def ready(self) -> int:
        with self._cond:
            return len(self._done)

    def discard_pending(self) -> None:
        with self._cond:
            self._assigned.clear()
            self._done.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tasks in self._task_queues:
            try:
                tasks.put(None)
            except (OSError, ValueError):
                pass
        for process in self._workers:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        try:
            self._results.put(None)  # wake the receiver now rather than at its next poll
        except (OSError, ValueError):
            pass
        self._receiver.join(timeout=5)
        self._results.cancel_join_thread()
        self._results.close()
        self._slots.clear()
        with self._cond:
            self._done.clear()
            self._assigned.clear()

    def pids(self) -> list[int]:
        return [p.pid for p in self._workers if p.pid is not None]


def make_pool(producer: BatchProducer, num_workers: int, worker_type: str, *,
              context: str | None = None, timeout: float | None = None) -> Any:
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if num_workers == 0:
        return InlinePool(producer)
    if worker_type == "thread":
        return ThreadPool(producer, num_workers)
    if worker_type == "process":
        return ProcessPool(producer, num_workers, context=context, timeout=timeout)
    raise ValueError(f"worker_type must be 'process' or 'thread', got {worker_type!r}")


