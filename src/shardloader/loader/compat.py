"""DataLoader's arguments and defaults, mapped onto the Loader's (pure functions).

The Loader takes DataLoader's arguments with DataLoader's defaults, so that replacing one with
the other is a one-line change. Where DataLoader has an argument the Loader cannot honour
without giving up exact resume (a sampler, an RNG stream), it is refused with what to use
instead: silently ignoring it would change which samples a run sees.
"""

from __future__ import annotations

from typing import Any

from shardloader.order.partition import check_tail

_SAMPLER_ADVICE = (
    "the Loader orders samples itself, as a pure function of (seed, epoch, shuffle) so that "
    "resume is exact: drop a DistributedSampler (rank and world size come from "
    "torch.distributed; batch_size is per rank), use shuffle=True/False and seed= for "
    "RandomSampler/SequentialSampler, and torch.utils.data.Subset(dataset, indices) for a "
    "subset. Weighted or custom samplers are not supported"
)


def check_dataloader_arguments(*, batch_size: Any, sampler: Any, batch_sampler: Any,
                               generator: Any, in_order: bool, pin_memory_device: str) -> None:
    """Raise ValueError/TypeError for DataLoader arguments the Loader does not take, saying what
    to use instead."""
    if batch_size is None:
        raise ValueError(
            "batch_size=None (unbatched samples) is not supported: the Loader's state counts "
            "batches. Use batch_size=1 and index the batch, or iterate the dataset directly"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if sampler is not None:
        raise ValueError(f"sampler= is not supported: {_SAMPLER_ADVICE}")
    if batch_sampler is not None:
        raise ValueError(f"batch_sampler= is not supported: {_SAMPLER_ADVICE}; batches are "
                         f"batch_size consecutive samples of that order")
    if generator is not None:
        raise ValueError(
            "generator= is not supported: the Loader draws from no RNG stream. The order and "
            "each sample's augmentation keys are pure functions of seed=, the epoch and the "
            "sample index (that is what makes resume exact under any num_workers); pass "
            "seed=<int> instead, e.g. seed=generator.initial_seed()"
        )
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
