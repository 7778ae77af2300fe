"""Worker pools that run BatchProducer tasks and hand results back in submission order.

Three kinds, same interface (`submit(task)`, `get(task_id)`, `ready()`, `close()`):

- `InlinePool` (num_workers=0): produces in the caller's thread when asked.
- `ThreadPool`: threads; right when decode releases the GIL (simplejpeg, OpenCV do).
- `ProcessPool`: worker processes (fork by default, like DataLoader on Linux). Batches come
  back through torch.multiprocessing queues (tensors travel in shared memory). A worker that
  dies is detected while waiting and raised as WorkerError naming it — never a hang.

Results are keyed by task id and handed out in the order the loader asks for them, so output
never depends on which worker finished first.
"""

from __future__ import annotations

import concurrent.futures
import queue
import signal
import threading
import traceback
from typing import Any

import torch.multiprocessing as torch_mp

from shardloader.errors import WorkerError
from shardloader.loader.batches import BatchProducer, BatchTask, BatchTimings

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
        self._executor = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="shardloader")
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


def _worker_main(worker_id: int, producer: BatchProducer, tasks: Any, results: Any) -> None:
    # Ctrl-C goes to the main process, which shuts workers down; workers must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import cv2

        cv2.setNumThreads(1)  # workers parallelise; OpenCV's own pool would oversubscribe cores
    except ImportError:  # pragma: no cover - opencv is a dependency
        pass
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            results.put((task.task_id, True, producer(task)))
        except Exception as e:  # noqa: BLE001 - every failure is reported to the caller
            message = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            results.put((task.task_id, False, message))


class ProcessPool:
    """Worker processes; tasks are dealt round-robin, results reordered by task id."""

    def __init__(self, producer: BatchProducer, num_workers: int, *, context: str | None = None,
                 timeout: float | None = None) -> None:
        ctx = torch_mp.get_context(context or "fork")
        self.timeout = timeout
        self._results = ctx.Queue()
        self._task_queues = [ctx.SimpleQueue() for _ in range(num_workers)]
        self._workers = []
        for worker_id, tasks in enumerate(self._task_queues):
            process = ctx.Process(
                target=_worker_main,
                args=(worker_id, producer, tasks, self._results),
                name=f"shardloader-worker-{worker_id}",
                daemon=True,
            )
            process.start()
            self._workers.append(process)
        self._next_worker = 0
        self._assigned: dict[int, int] = {}  # task id -> worker id
        self._done: dict[int, tuple[bool, Any]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, task: BatchTask) -> None:
        worker_id = self._next_worker
        self._next_worker = (self._next_worker + 1) % len(self._workers)
        self._assigned[task.task_id] = worker_id
        self._task_queues[worker_id].put(task)

    def _drain(self, block: bool) -> None:
        try:
            task_id, ok, payload = self._results.get(timeout=_POLL_SECONDS) if block else self._results.get_nowait()
        except queue.Empty:
            return
        if task_id in self._assigned:
            self._done[task_id] = (ok, payload)
        # else: a result of a discarded task (an abandoned iterator); drop it.

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
        waited = 0.0
        while task_id not in self._done:
            self._check_alive(task_id)
            self._drain(block=True)
            waited += _POLL_SECONDS
            if self.timeout is not None and waited > self.timeout:
                raise WorkerError(f"batch task {task_id} took longer than the {self.timeout} s timeout")
        ok, payload = self._done.pop(task_id)
        del self._assigned[task_id]
        if not ok:
            raise WorkerError(f"worker process failed on batch task {task_id}: {payload}")
        return payload

    def ready(self) -> int:
        while True:
            before = len(self._done)
            self._drain(block=False)
            if len(self._done) == before:
                return len(self._done)

    def discard_pending(self) -> None:
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
        self._results.cancel_join_thread()
        self._results.close()

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


