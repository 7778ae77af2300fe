"""The staging pool: one reusable host buffer that a save copies tensors into, then returns.

Training pays for exactly this copy. The pool is allocated once (pinned when CUDA is present,
so device-to-host copies run at full speed and asynchronously), grown only when a larger state
arrives, and reused by every later save. Its size is capped: by default the state's size,
bounded by a fraction of the memory available, so a typical save blocks for one copy only.
When the state is larger than the cap, the save streams it through the pool in rounds: copy a
pool-full, let the writer drain it to local disk, copy the next. Only the last round's write is
then left to the background.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shardloader.checkpoint.tensorfile import TensorMeta, data_size, file_order

ALIGN = 16  # rounds start at multiples of the largest element size (complex128)
DEFAULT_MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of tensor `index` (flattened), at byte `pool_offset` of the pool."""

    index: int
    start: int
    stop: int
    pool_offset: int
    nbytes: int


@dataclass(frozen=True)
class Round:
    """Bytes [offset, offset + nbytes) of the file's data section, staged in the pool at 0.

    The pool holds a round exactly as the file does (same order, no gaps), so the writer
    writes and hashes a round with one call each: few GIL round trips for the writer thread.
    """

    offset: int
    nbytes: int
    segments: tuple[Segment, ...]


def plan_rounds(metas: list[TensorMeta], capacity: int) -> list[Round]:
    """Cut the data section into consecutive rounds of at most `capacity` bytes.

    A tensor crossing a round boundary is split there; boundaries are multiples of 16 bytes and
    tensors start at multiples of their element size (see tensorfile), so every piece is whole
    elements and every pool offset is aligned for its dtype.
    """
    if capacity < ALIGN:
        raise ValueError(f"staging capacity {capacity} is below the minimum of {ALIGN} bytes")
    capacity -= capacity % ALIGN
    total = data_size(metas)
    order = [i for i in file_order(metas) if metas[i].nbytes]
    rounds = []
    for lo in range(0, max(total, 1), capacity):
        hi = min(total, lo + capacity)
        segments = []
        for i in order:
            m = metas[i]
            if m.end <= lo or m.begin >= hi:
                continue
            a, b = max(m.begin, lo), min(m.end, hi)
            itemsize = m.itemsize
            segments.append(Segment(i, (a - m.begin) // itemsize, (b - m.begin) // itemsize,
                                    a - lo, b - a))
        rounds.append(Round(lo, hi - lo, tuple(segments)))
    return rounds


def pool_bytes_needed(metas: list[TensorMeta]) -> int:
    """Bytes a pool needs to hold every tensor at once: the file's data section (rounded up to
    the round granularity, so `plan_rounds(metas, pool_bytes_needed(metas))` is one round)."""
    return max(ALIGN, -(-data_size(metas) // ALIGN) * ALIGN)


def available_memory() -> int:
    """Bytes of memory the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class StagingPool:
    """A reusable host buffer plus the copy of a save's tensors into it.

    `cap_bytes` (None: automatic) is a hard limit on the pool's size; `memory_fraction` bounds
    the automatic cap by the memory available when the pool is sized.
    """

    def __init__(
        self,
        *,
        cap_bytes: int | None = None,
        memory_fraction: float = DEFAULT_MEMORY_FRACTION,
        pin_memory: bool | None = None,
    ) -> None:
        if cap_bytes is not None and cap_bytes < ALIGN:
            raise ValueError(f"staging cap_bytes must be at least {ALIGN}, got {cap_bytes}")
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        self.cap_bytes = cap_bytes
        self.memory_fraction = memory_fraction
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.buffer: torch.Tensor | None = None
        self.allocations = 0

    @property
    def size(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def capacity_for(self, needed: int) -> int:
        """The pool size to use for a state needing `needed` bytes: the state, within the cap."""
        cap = self.cap_bytes
        if cap is None:
            cap = int((available_memory() + self.size) * self.memory_fraction)
        return max(ALIGN, min(needed, cap))

    def reserve(self, nbytes: int) -> None:
        """Make the pool at least `nbytes` large (allocating only when it must grow)."""
        if self.size >= nbytes:
            return
        self.buffer = None  # free the old pool before allocating the new one
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.allocations += 1

    def copy_in(self, round_: Round, tensors: list[torch.Tensor]) -> None:
        """Copy each segment of the round into its place in the pool; returns when done."""
        assert self.buffer is not None
        devices = set()
        for seg in round_.segments:
            src = tensors[seg.index]
            if seg.nbytes == 0:
                continue
            dst = self.buffer[seg.pool_offset : seg.pool_offset + seg.nbytes].view(src.dtype)
            if seg.start == 0 and seg.stop == src.numel():
                dst.view(src.shape).copy_(src, non_blocking=src.is_cuda)
            else:
                dst.copy_(src.reshape(-1)[seg.start : seg.stop], non_blocking=src.is_cuda)
            if src.is_cuda:
                devices.add(src.device)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def view(self, round_: Round) -> memoryview:
        """The staged bytes of `round_`, for writing and hashing without a copy."""
        assert self.buffer is not None
        return memoryview(self.buffer[: round_.nbytes].numpy())

    def release(self) -> None:
        self.buffer = None
