"""`PoolKeeper`: a Loader's workers across its epochs, and the ids of the tasks they run.

The pool (`shardloader.loader.workers.pool`) is started on an epoch's first need, released at
the epoch's end unless `persistent_workers`, and closed within a bound; persistent workers
keep the producer they were started with. Task ids are unique over the Loader's life, so a
persistent pool never confuses a batch of an abandoned epoch with one of the next.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from shardloader.loader.batches import BatchProducer
from shardloader.loader.workers.pool import CLOSE_SECONDS, make_pool

#: The longest a pool's start waits for the threads fetching what its workers inherit (a bound,
#: as the first batch's own priming has: `shardloader.loader.prefetch_policy`).
INHERIT_SECONDS = 30.0


class PoolKeeper:
    """Starts, hands out and releases the worker pool of one Loader."""

    def __init__(self, producer: BatchProducer, *, num_workers: int, worker_type: str,
                 context: str | None, timeout: float | None, prefetch_factor: int,
                 persistent: bool, worker_dataset: Any = None) -> None:
        self.producer = producer
        self.worker_dataset = worker_dataset  # what get_worker_info().dataset is in a worker
        self.num_workers = num_workers
        self.worker_type = worker_type
        self.context = context
        self.timeout = timeout
        self.prefetch_factor = prefetch_factor
        self.persistent = persistent
        self.pool: Any = None  # the running pool, or None
        self._last_task_id = 0
        self._inherited: list[threading.Thread] = []  # fetching what workers forked later inherit

    @property
    def depth(self) -> int:
        """How many batches an epoch keeps submitted ahead of the one it waits for."""
        return max(1, self.num_workers) * self.prefetch_factor

    @property
    def forks(self) -> bool:
        """Whether the workers are processes (forked, unless another start method is set)."""
        return self.num_workers > 0 and self.worker_type == "process"

    def would_inherit(self) -> bool:
        """Whether workers started now share this process's memory: none are running yet
        (persistent ones would not see what is fetched now), and they are inline, threads, or
        processes forked (not started fresh by "spawn" or "forkserver")."""
        return self.pool is None and not (self.forks and (self.context or "fork") != "fork")

    def inherit(self, thread: threading.Thread) -> None:
        """`thread` fetches what workers started later should inherit (a Loader's first batch,
        primed from `Loader()`): the pool is not forked while it runs (`get`)."""
        self._inherited = [t for t in self._inherited if t.is_alive()] + [thread]

    def wait_inherited(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds in all for the `inherit` threads; whether they ended."""
        deadline = time.monotonic() + timeout
        for thread in self._inherited:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._inherited = [t for t in self._inherited if t.is_alive()]
        return not self._inherited

    def get(self) -> Any:
        """The running pool, started now if there is none: after the `inherit` threads (at most
        `INHERIT_SECONDS`), so that forked workers get what they fetched and no thread of
        ours is mid-request at the fork."""
        if self.pool is None:
            self.wait_inherited(INHERIT_SECONDS)
            self.pool = make_pool(self.producer, self.num_workers, self.worker_type,
                                  context=self.context, timeout=self.timeout,
                                  prefetch_factor=self.prefetch_factor,
                                  worker_dataset=self.worker_dataset)
            self.producer.dataset_state = None  # loaded by the workers just started, not later ones
        return self.pool

    def release(self, force: bool = False, timeout: float = CLOSE_SECONDS) -> None:
        """An epoch is over: close the pool, unless its workers persist (`force` closes them
        too), within about `timeout` seconds."""
        if self.pool is not None and (force or not self.persistent):
            pool, self.pool = self.pool, None
            pool.close(timeout)

    def abandon(self) -> None:
        """Drop the pool without waiting (from `__del__`): workers are killed; pipes close with
        their objects."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        abandon = getattr(pool, "abandon", None)
        if abandon is not None:
            abandon()
        else:
            pool.close(0.0)

    def new_task_id(self) -> int:
        self._last_task_id += 1
        return self._last_task_id
