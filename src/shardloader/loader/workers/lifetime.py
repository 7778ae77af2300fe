"""What outlives one pool: the registries of live pools and their threads, and the bounded end
of both at interpreter exit (`end_pools_at_exit`).

Process pools register here so that a forked worker can close the pipe ends of every other
live pool (`shardloader.loader.workers.pool`); pool threads (receivers, worker threads)
register so that exit can wait for them, bounded.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

#: How long `close()` lets workers finish before it terminates (then kills) them, in all.
CLOSE_SECONDS = 5.0

#: Process pools alive in this process. A forked worker closes their pipe ends (it must not
#: hold them); a weak set, so a pool nobody references is not kept alive by it.
_LIVE_POOLS: weakref.WeakSet[Any] = weakref.WeakSet()
#: The pools' threads (receivers, worker threads): daemons that may drop the last reference to
#: a batch's tensors on their way out. See `end_pools_at_exit`.
_POOL_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: How long interpreter exit waits for the pools' threads, in all.
EXIT_JOIN_SECONDS = 1.0


def end_pools_at_exit(timeout: float = EXIT_JOIN_SECONDS) -> None:
    """At interpreter exit, once the live loaders are closed: abandon the pools nobody closed,
    and wait (bounded) until the pools' threads have ended.

    Why: a pool dropped without `close()` (a Loader garbage-collected, or left behind by a
    pipeline's thread) is abandoned, and its receiver thread notices within `_POLL_SECONDS`,
    then frees the pool and the tensors of the batches it holds. If that happens after the
    interpreter began finalising, CPython (before 3.14) ends the thread with `pthread_exit` from
    inside torch's tensor destructor, where the unwinding aborts the process: SIGABRT,
    "terminate called without an active exception", in 4 of 20 runs of a script that dropped
    its Loader without `close()` and returned. A thread still busy after `timeout` (a worker
    thread stuck in a read) is left as it is."""
    for pool in list(_LIVE_POOLS):
        try:
            pool.abandon()
        except Exception:  # noqa: BLE001 - e.g. in a forked child, whose pools are not its own
            pass
    deadline = time.monotonic() + timeout
    for thread in list(_POOL_THREADS):
        if thread is not threading.current_thread() and thread.is_alive():
            thread.join(max(0.0, deadline - time.monotonic()))
