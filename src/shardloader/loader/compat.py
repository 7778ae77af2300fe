"""DataLoader's arguments and defaults, mapped onto the Loader's (pure functions).

The Loader takes DataLoader's arguments with DataLoader's defaults, so that replacing one with
the other is a one-line change. Where DataLoader has an argument the Loader cannot honour
(`in_order=False`, `pin_memory_device=`), it is refused with what to use instead: silently
ignoring it would change what a run sees. Samplers: `shardloader.loader.sampling`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import numbers
import os
import warnings
from typing import Any

from shardloader.order.partition import check_tail


def check_dataloader_arguments(*, batch_size: Any, in_order: bool, pin_memory_device: str) -> None:
    """Raise ValueError/TypeError for DataLoader arguments the Loader does not take, saying what
    to use instead (`sampler=`, `batch_sampler=` and their combinations: `loader.sampling`)."""
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer (or None: unbatched), got {batch_size!r}")
    if not in_order:
        raise ValueError(
            "in_order=False is not supported: batches always arrive in order, so that they and "
            "the resume state do not depend on worker timing"
        )
    if pin_memory_device:
        raise ValueError(
            "pin_memory_device= is not supported (deprecated in torch): pin_memory=True pins "
            "for the current accelerator"
        )


def resolve_tail(tail: str | None, drop_last: bool, world_size: int) -> str:
    """The tail policy from DataLoader's `drop_last` and the explicit `tail`.

    drop_last=True is "drop". Otherwise, in one process, "partial": every sample exactly once
    with a short last batch, as DataLoader. Under world_size > 1, "pad": every rank must take
    the same number of steps or DistributedDataParallel hangs in its collectives, so the last
    global batch is filled from the epoch's start, as DistributedSampler pads (its default)
    — the count is in `Loader.tail_report()`. An explicit `tail` wins over both.
    """
    if tail is not None:
        check_tail(tail)
        if drop_last and tail != "drop":
            raise ValueError(f"drop_last=True contradicts tail={tail!r}: pass one of them")
        return tail
    if drop_last:
        return "drop"
    return "partial" if world_size == 1 else "pad"


def check_worker_init(worker_init_fn: Any, num_workers: int, worker_type: str) -> None:
    """`worker_init_fn` runs once in each worker process, as DataLoader runs it; refuse it
    where it would never run (thread workers share this process)."""
    if worker_init_fn is None:
        return
    if not callable(worker_init_fn):
        raise TypeError(f"worker_init_fn must be callable, got {worker_init_fn!r}")
    if num_workers > 0 and worker_type == "thread":
        raise ValueError(
            "worker_init_fn runs once in each worker process; thread workers share this "
            "process, so call it yourself before iterating, or use worker_type='process'"
        )


def check_worker_arguments(*, num_workers: Any, timeout: Any, prefetch_factor: Any,
                           persistent_workers: bool, worker_type: str) -> int | None:
    """Refuse the worker settings DataLoader refuses, with its exception types; the prefetch
    factor as DataLoader keeps it (None without workers, 2 by default with them)."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool):
        raise TypeError(f"num_workers must be an integer, got {num_workers!r}")
    if num_workers < 0:
        raise ValueError("num_workers option should be non-negative; use num_workers=0 to load in "
                         f"the training process (got num_workers={num_workers})")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)):
        raise TypeError(f"timeout must be a number of seconds (or None), got {timeout!r}")
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout option should be non-negative, got timeout={timeout!r}")
    if worker_type not in ("process", "thread"):
        raise ValueError(f"worker_type must be 'process' or 'thread', got {worker_type!r}")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor needs workers: it is how many batches each worker prepares ahead. "
            "Pass num_workers > 0, or leave prefetch_factor as None (as DataLoader requires)"
        )
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0 (workers to keep)")
    if num_workers > 0 and prefetch_factor is None:
        return 2
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or isinstance(prefetch_factor, bool)):
        raise TypeError(f"prefetch_factor must be an integer (or None), got {prefetch_factor!r}")
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be a positive integer, got {prefetch_factor!r}")
    return prefetch_factor


def resolve_context(context: Any, *, num_workers: int, worker_type: str) -> tuple[Any, str | None]:
    """(the multiprocessing context, its start method) for `multiprocessing_context=`: None or
    a start method's name ("fork", "spawn", "forkserver") or a context object, as DataLoader
    takes it. Refused at construction, with DataLoader's exception types, where it would fail
    or be ignored later: an unknown name, another kind of object, or no worker processes."""
    if context is None:
        return None, None
    if num_workers == 0 or worker_type != "process":
        raise ValueError(
            "multiprocessing_context can only be used with worker processes (num_workers > 0, "
            f"worker_type='process'), but got num_workers={num_workers}, worker_type={worker_type!r}"
        )
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(f"multiprocessing_context option should specify a valid start method "
                             f"in {methods!r}, but got multiprocessing_context={context!r}")
        context = multiprocessing.get_context(context)
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string naming "
            f"a start method (one of {multiprocessing.get_all_start_methods()!r}), but got "
            f"multiprocessing_context={context!r}"
        )
    return context, context.get_start_method()


def warn_worker_count(num_workers: int, worker_type: str) -> None:
    """Warn, as DataLoader does, when more worker processes are asked for than this process may
    use CPUs: they then take turns on the cores, and each costs its memory."""
    if num_workers == 0 or worker_type != "process":
        return
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    if cpus and num_workers > cpus:
        warnings.warn(
            f"This Loader will create {num_workers} worker processes, and this process may use "
            f"{cpus} CPUs: the workers will take turns on them, each with its own memory. "
            f"num_workers={cpus} or fewer is the most that can run at once; lower it unless the "
            f"workers mostly wait on I/O.",
            UserWarning, stacklevel=4,  # the caller of Loader(...), past __init__ and gc_paused
        )


def resolve_seed(seed: Any, generator: Any) -> Any:
    """The order's seed: `seed=` when given, else the `generator=`'s initial_seed() (DataLoader
    draws its order from that generator; the Loader's order is a pure function of the seed, so
    two Loaders given generators seeded alike read alike), else 0."""
    if seed is not None:
        return seed
    if generator is not None:
        return int(generator.initial_seed())
    return 0


def check_seed(seed: Any) -> int:
    """The seed as an int; refuse what is not one (1.7 would silently be 1)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    return int(seed)


def warn_if_no_batches(num_samples: int, global_batch_size: int, tail: str) -> None:
    """Warn once when every epoch would have no batch: drop_last with fewer samples than one
    global batch (DataLoader yields nothing there, silently)."""
    if tail == "drop" and 0 < num_samples < global_batch_size:
        warnings.warn(
            f"drop_last=True with {num_samples} samples and a global batch of {global_batch_size}: "
            f"every epoch has no batch at all. Lower batch_size, or pass drop_last=False",
            UserWarning, stacklevel=4,  # the caller of Loader(...), past __init__ and gc_paused
        )
