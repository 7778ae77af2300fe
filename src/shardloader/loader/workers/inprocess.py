"""The pools that run in the training process: `InlinePool` (num_workers=0: each batch is made
when asked for, in the caller's thread) and `ThreadPool` (worker threads; right when decode
releases the GIL, as simplejpeg and OpenCV do). Same interface as `ProcessPool`.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

from shardloader.errors import WorkerError
from shardloader.loader.batches import BatchProducer, BatchTask, BatchTimings
from shardloader.loader.failures import in_this_process
from shardloader.loader.workers.lifetime import _POOL_THREADS, CLOSE_SECONDS

#: A batch (or a `BatchFailure` in its place: see `shardloader.loader.failures`) and its timings.
Result = tuple[object, BatchTimings]


class InlinePool:
    """No workers: each batch is produced when the caller asks for it."""

    def __init__(self, producer: BatchProducer) -> None:
        self.producer = producer
        self._tasks: dict[int, BatchTask] = {}

    def submit(self, task: BatchTask, worker: int | None = None) -> None:
        """`worker`: there is one, this process (the argument is the pools' interface)."""
        self._tasks[task.task_id] = task

    def get(self, task_id: int) -> Result:
        task = self._tasks.pop(task_id)
        try:
            return self.producer(task)
        except Exception as e:  # noqa: BLE001 - the dataset's error, raised for this batch
            return in_this_process(e, task.epoch, task.step), BatchTimings()

    def ready(self) -> int:
        return 0

    def discard_pending(self) -> None:
        self._tasks.clear()

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        self._tasks.clear()


class ThreadPool:
    """Worker threads sharing the process (and its open shard readers). In them
    `torch.utils.data.get_worker_info()` is None, as in the training process (see
    `shardloader.loader.workers.worker_process`).

    Daemon threads, not a `concurrent.futures.ThreadPoolExecutor`: the executor's threads are
    joined without a limit at interpreter exit, so one batch stuck in a read (a silent server)
    would hang the script's exit forever. A daemon thread still busy then is abandoned."""

    def __init__(self, producer: BatchProducer, num_workers: int, *, timeout: float | None = None) -> None:
        self.producer = producer
        self.timeout = timeout
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Result], BatchTask] | None] = \
            queue.SimpleQueue()
        self._futures: dict[int, concurrent.futures.Future[Result]] = {}
        self._threads = [threading.Thread(target=self._work, name=f"shardloader-worker-{i}", daemon=True)
                         for i in range(num_workers)]
        for thread in self._threads:
            _POOL_THREADS.add(thread)
            thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, task = item
            if not future.set_running_or_notify_cancel():  # discarded before it started
                continue
            try:
                future.set_result(self.producer(task))
            except Exception as e:  # noqa: BLE001 - the dataset's error, raised for this batch
                future.set_result((in_this_process(e, task.epoch, task.step), BatchTimings()))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the batch
                future.set_exception(e)

    def submit(self, task: BatchTask, worker: int | None = None) -> None:
        """`worker` is ignored: any thread takes the task (threads share the dataset)."""
        future: concurrent.futures.Future[Result] = concurrent.futures.Future()
        self._futures[task.task_id] = future
        self._queue.put((future, task))

    def get(self, task_id: int) -> Result:
        future = self._futures.pop(task_id)
        try:
            return future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            raise WorkerError(f"Loader timed out after {self.timeout} seconds waiting for batch task "
                              f"{task_id} from a worker thread (timeout={self.timeout})") from None
        except Exception as e:
            raise WorkerError(f"worker thread failed on batch task {task_id}: {e}") from e

    def ready(self) -> int:
        return sum(f.done() for f in self._futures.values())

    def discard_pending(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Cancel queued tasks and wait up to `timeout` for the batches in progress.

        A thread cannot be stopped from outside: one still busy after `timeout` (a read stuck
        on a slow network, say) is left to finish on its own (it is a daemon: it never holds
        up the interpreter's exit); its result is discarded."""
        self.discard_pending()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
