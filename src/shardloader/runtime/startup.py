"""Keeping the garbage collector's full collections off the path to the first batch.

Building a loader and starting its workers allocates many objects (imports of the reader and
image libraries, the index, telemetry), and in a process that holds torch a full collection
walks hundreds of thousands of objects: 50-100 ms each on this project's 2-core machine. Where
one fell on the path to the first batch it was a third of it (measured with
`benchmarks.memory`'s run: `Loader(...)` took 81-107 ms instead of 5 ms when a full collection
landed in it; perf showed `gc_collect_main` as the top symbol of `warm_up`'s imports).

The same in `Dataset(...)`: for a remote URL it imports the node cache's modules and loads the
index, and took 112-133 ms instead of 30-40 (a fresh process on loopback S3, four runs each;
the cold first batch's construction phase) when a full collection fell into those imports.

The same in the imports of `from shardloader import Dataset, Loader` after `import torch`: a
full collection fell into them every time (93-126 ms of 0.18-0.30 s, `python -X importtime`
and `gc.callbacks`, five fresh processes), so the first use of a public name imports its
module under `paused_gc()` (`shardloader/__init__.py`).

`paused_gc()` defers collections while our own start-up code runs (the dataset's and the
loader's constructors, the start of an epoch's iteration, the wait for its first batch) and
re-enables the collector as soon as that code returns, so user code never runs with it paused
by us. A collector the application disabled stays disabled.

Deferring alone only moved the cost: what the pause allocated was all still in the youngest
generation, and the collection at the next allocation after the pause walked it, promoted it,
and so set off a full collection, inside the first `next()` (124 ms without workers, 241 ms
with two: `benchmarks/coldstart.py`, a cold first batch from S3 of 0.54 and 0.66 s). So at the
end of a pause what survived it is promoted to the oldest generation uncollected (`gc.freeze()`
then `gc.unfreeze()`: two O(1) list splices, and the promoted objects do not count towards the
next full collection). Start-up objects are long-lived (modules, the index, the loader); the
few reference cycles among them that are garbage wait for the next full collection instead of
the next young one. Where the application froze objects itself (`gc.get_freeze_count()`), the
pause leaves its generations alone.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


#: Whether a `paused_gc()` block of this process has the collector paused (a process forked
#: inside one inherits this, with the collector off: see `collect_in_forked_worker`).
_paused_here = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic garbage collection inside the block (restored on exit, also on errors)."""
    global _paused_here
    if not gc.isenabled():
        yield
        return
    gc.disable()
    _paused_here = True
    try:
        yield
    finally:
        _paused_here = False
        if gc.get_freeze_count() == 0:
            gc.freeze()  # what the pause allocated, promoted uncollected (see the module's docs)
            gc.unfreeze()
        gc.enable()


def collect_in_forked_worker() -> None:
    """First thing in a worker process: collect garbage as the training process does, but
    never walk what the worker inherited.

    Workers are forked while the loader starts, inside `paused_gc()`, and a forked child keeps
    its parent's collector state: without this, workers ran with the collector off for their
    whole life, so reference cycles made by a transform (a caught exception and its traceback,
    many libraries' objects) were never freed and a worker's memory grew batch after batch
    (tests/test_workers.py makes 1 MB of cyclic garbage per sample). The collector is switched
    back on unless the application itself had switched it off (then it stays off, as in the
    training process).

    `gc.freeze()` first moves every inherited object out of the collector's reach (an O(1)
    list splice): collections then walk only the worker's own objects, and never write the
    inherited objects' GC headers, which would copy the parent's pages into the worker one by
    one (the forking recipe of the `gc` module's documentation)."""
    gc.freeze()
    if _paused_here and not gc.isenabled():
        gc.enable()


def gc_paused(function: F) -> F:
    """Decorator: run `function` under `paused_gc()`."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with paused_gc():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
