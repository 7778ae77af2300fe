"""Splitting an epoch's global sequence into steps and ranks, and handling its tail.

A step consumes `global_batch` consecutive positions. Rank r of W takes the positions of the
step that are = r (mod W), so `global_batch` must be a multiple of W and every rank gets
`global_batch // W` positions per step. The tail (the last N mod global_batch samples) is
handled by a policy that depends only on N and the global batch, never on W, so the last
step holds the same samples under any world size:

- "pad":     the last step is filled up with samples from the start of the epoch; every rank
             gets the same number of full batches (DistributedDataParallel cannot hang).
- "drop":    the incomplete last step is dropped.
- "partial": the last step is short; ranks get what falls to them (possibly nothing, which
             can hang DDP: meant for a single process or code that handles it).
"""

from __future__ import annotations

import numpy as np

TAILS = ("pad", "drop", "partial")


def check_tail(tail: str) -> str:
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {', '.join(TAILS)}; got {tail!r}")
    return tail


def epoch_length(num_samples: int, global_batch: int, tail: str) -> int:
    """Number of positions an epoch consumes (padding included, dropped tail excluded)."""
    check_tail(tail)
    if global_batch < 1:
        raise ValueError(f"global batch size must be positive, got {global_batch}")
    full, rest = divmod(num_samples, global_batch)
    if tail == "drop" or rest == 0:
        return full * global_batch
    if tail == "pad":
        return (full + 1) * global_batch
    return num_samples


def steps_per_epoch(num_samples: int, global_batch: int, tail: str) -> int:
    return -(-epoch_length(num_samples, global_batch, tail) // global_batch)


def padded_samples(num_samples: int, global_batch: int, tail: str) -> int:
    """Samples repeated to fill the last step (tail='pad')."""
    return max(0, epoch_length(num_samples, global_batch, tail) - num_samples)


def dropped_samples(num_samples: int, global_batch: int, tail: str) -> int:
    """Samples never reached in the epoch (tail='drop')."""
    return max(0, num_samples - epoch_length(num_samples, global_batch, tail))


def check_world(global_batch: int, world_size: int, rank: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if global_batch % world_size:
        raise ValueError(
            f"the global batch size {global_batch} is not a multiple of the world size {world_size}"
        )


def step_positions(
    step: int, rank: int, world_size: int, global_batch: int, num_samples: int, tail: str
) -> np.ndarray:
    """Epoch positions rank `rank` reads at step `step`, in global order, wrapped into [0, N).

    Positions past N (padding) wrap to the start of the epoch's sequence.
    """
    check_world(global_batch, world_size, rank)
    length = epoch_length(num_samples, global_batch, tail)
    start = step * global_batch
    stop = min(start + global_batch, length)
    positions = np.arange(start + rank, stop, world_size, dtype=np.int64)
    if num_samples and positions.size and positions[-1] >= num_samples:
        positions = positions % num_samples
    return positions


def step_counts(
    step: int, rank: int, world_size: int, global_batch: int, num_samples: int, tail: str
) -> tuple[int, int]:
    """(size, padded) of `step_positions(...)` without building it: how many positions rank
    `rank` reads at `step`, and how many of them are padding (past N, wrapped). Arithmetic on
    ranges: the training thread asks this for every batch it submits, and the array costs
    ~40 us of numpy overhead each time."""
    check_world(global_batch, world_size, rank)
    length = epoch_length(num_samples, global_batch, tail)
    start = step * global_batch + rank
    stop = min(step * global_batch + global_batch, length)
    size = len(range(start, stop, world_size))
    return size, size - len(range(start, min(stop, num_samples), world_size))

