"""Keeping the garbage collector's full collections off the path to the first batch.

Building a loader and starting its workers allocates many objects (imports of the reader and
image libraries, the index, telemetry), and in a process that holds torch a full collection
walks hundreds of thousands of objects: 50-100 ms each on this project's 2-core machine. Where
one fell on the path to the first batch it was a third of it (measured with
`benchmarks.memory`'s run: `Loader(...)` took 81-107 ms instead of 5 ms when a full collection
landed in it; perf showed `gc_collect_main` as the top symbol of `warm_up`'s imports).

`paused_gc()` defers collections while the loader's own start-up code runs (the constructor,
the start of an epoch's iteration, the wait for its first batch) and re-enables the collector
as soon as that code returns, so user code never runs with it paused by us. The collection is
deferred, not skipped: it runs at the next allocation after the pause, off the first batch's
path. A collector the application disabled stays disabled.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic garbage collection inside the block (restored on exit, also on errors)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def gc_paused(function: F) -> F:
    """Decorator: run `function` under `paused_gc()`."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with paused_gc():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
