"""Moving batches from worker processes to the loader through reused shared-memory slots.

Sending a tensor through a torch.multiprocessing queue moves its storage into a new
shared-memory segment and passes the segment's file descriptor over a socket, with an
authenticated connection to the sending process per tensor. For a batch of 64 small images
that cost about as much CPU as decoding a tenth of the batch, on both sides, and every batch
faults in fresh pages. Here each worker owns a few shared-memory slots instead: it writes the
batch's tensors into a free slot and sends only the batch's structure (small) and where each
tensor lies. A slot's descriptor crosses once, when the worker creates it; the slots are
reused for every later batch.

The loader hands the tensors out as views of the slot (no copy), and the slot goes back to its
worker once every one of them is gone: each tensor's memory is a numpy view of the slot whose
finalizer gives it back (see `SlotReader._lend`). Whatever the user keeps (a view, a numpy
array of it, the storage) keeps the slot lent, so a lent slot is never written while anything can still
read it; the worker makes another slot meanwhile (it never waits). Each tensor has its own
storage of exactly its bytes (`torch.save` of a label writes the label, not the slot). A
worker lends at most `LEND_PER_WORKER` slots at once; beyond that (a script that keeps every
batch) the batch is copied out into private memory and its slot given back at once, so
slots, their memory and their file descriptors stay bounded.

Why not copy always (as before): the copy was the training process's largest cost per batch,
about 13 us per 112 px sample (a 2.4 MB memcpy into fresh pages, on the receiver thread, which
competes with the training thread for the GIL and with the workers for the cores), and the
copies' freed memory stayed in glibc's heap.

Exactness: tensors travel byte for byte, with their dtype and shape. Anything that is not a
plain CPU tensor (numpy arrays, strings, tensors that need grad, sparse or quantized ones, ...)
stays in the structure and is pickled as before.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardloader.loader.workers.frames import frame

_ALIGN = 64
_MIN_SLOT_BYTES = 1 << 20
#: Slots of one worker lent at once (see the module's docstring), at least: batches waiting to
#: be taken count too, so a pool lends `prefetch_factor + 2` when that is more. A training loop
#: holds one or two batches; more than this means batches are being kept.
LEND_PER_WORKER = 4
#: Room `allocate` leaves after the reserved tensor for the batch's other tensors (labels...).
_RESERVE_EXTRA = 64 << 10
# dtypes whose bytes can be viewed as uint8 and rebuilt exactly
_PLAIN_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128,
})


@dataclass(frozen=True)
class TensorRef:
    """Stands in the structure for tensor `index` of the batch's slot layout."""

    index: int


@dataclass(frozen=True)
class Packed:
    """A batch on its way to the loader: structure with TensorRefs, and where they lie."""

    structure: Any
    slot: int | None  # None: no tensors travelled through a slot
    layout: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]  # (offset, shape, dtype)
    new_slots: dict[int, torch.UntypedStorage]
    retired: tuple[int, ...]


def _plain(value: Any) -> bool:
    return (type(value) is torch.Tensor and value.device.type == "cpu"
            and value.layout == torch.strided and value.dtype in _PLAIN_DTYPES
            and not value.requires_grad and not value.is_conj() and not value.is_neg())


def _extract(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each plain tensor replaced by a TensorRef (dicts, lists, tuples walked)."""
    if _plain(value):
        tensors.append(value)
        return TensorRef(len(tensors) - 1)
    if type(value) is dict:
        return {k: _extract(v, tensors) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_extract(v, tensors) for v in value)
    return value


def _restore(value: Any, tensors: list[torch.Tensor]) -> Any:
    if type(value) is TensorRef:
        return tensors[value.index]
    if type(value) is dict:
        return {k: _restore(v, tensors) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_restore(v, tensors) for v in value)
    return value


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 numpy view (the tensor must be contiguous)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class SlotWriter:
    """Worker side: packs batches into this worker's slots. `returned` yields slot ids the
    loader has finished with (checked before every batch, never waited on)."""

    def __init__(self, returned: Any) -> None:
        self._returned = returned
        self._slots: dict[int, torch.Tensor] = {}  # id -> flat uint8 tensor on the storage
        self._free: list[int] = []
        self._next_id = 0
        # allocate(): (slot, tensor made there, its new storage and retired ids, if any)
        self._reserved: tuple[int, torch.Tensor, dict[int, torch.UntypedStorage], tuple[int, ...]] | None = None
        # from reservations given back unused: still to be sent with the next batch
        self._pending_new: dict[int, torch.UntypedStorage] = {}
        self._pending_retired: tuple[int, ...] = ()

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor at the start of a free slot, for the producer to
        build the batch's largest tensor in place: `pack` then finds it there and does not
        copy it (the other tensors go after it). Saves, per batch of 64 112 px images, a
        2.4 MB private allocation (fresh pages each time) and its copy into the slot.
        A reservation not used by the next `pack` goes back to the free slots."""
        self._release_reserved()
        nbytes = _aligned(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        slot, new_slots, retired = self._take(nbytes + _RESERVE_EXTRA)
        tensor = self._slots[slot][:nbytes].view(dtype)[:math.prod(shape)].view(shape)
        self._reserved = (slot, tensor, new_slots, retired)
        return tensor

    def _release_reserved(self) -> None:
        """Give an unused reservation's slot back; the new storage and retired ids it made must
        still reach the loader, with the next batch."""
        if self._reserved is None:
            return
        slot, _, new_slots, retired = self._reserved
        self._reserved = None
        self._free.append(slot)
        self._pending_new.update(new_slots)
        self._pending_retired += retired

    def pack(self, batch: Any) -> Packed:
        tensors: list[torch.Tensor] = []
        structure = _extract(batch, tensors)
        reserved, self._reserved = self._reserved, None
        placed = -1  # index of the tensor already in the reserved slot at offset 0
        if reserved is not None:
            placed = next((i for i, t in enumerate(tensors) if t is reserved[1]), -1)
            if placed < 0:  # not in this batch: the slot is free again
                self._reserved = reserved
                self._release_reserved()
        if not tensors:
            return self._with_pending(Packed(batch, None, (), {}, ()))
        tensors = [t.contiguous() for t in tensors]
        order = ([placed] if placed >= 0 else []) + [i for i in range(len(tensors)) if i != placed]
        starts = [0] * len(tensors)
        offset = 0
        for i in order:
            starts[i] = offset
            offset += _aligned(tensors[i].numel() * tensors[i].element_size())
        layout = [(starts[i], tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
        if placed >= 0 and self._slots[reserved[0]].numel() >= offset:
            slot, new_slots, retired = reserved[0], reserved[2], reserved[3]
        else:
            if placed >= 0:  # the rest does not fit after it: copy all into a larger slot
                self._reserved = reserved
                self._release_reserved()
                placed = -1
            slot, new_slots, retired = self._take(offset)
        buffer = self._slots[slot].numpy()
        for i, ((start, _, _), t) in enumerate(zip(layout, tensors)):
            if t.numel() and i != placed:
                data = _bytes_of(t)
                buffer[start:start + data.size] = data
        return self._with_pending(Packed(structure, slot, tuple(layout), new_slots, retired))

    def _with_pending(self, packed: Packed) -> Packed:
        """`packed` carrying also the slots made (or retired) by reservations never used."""
        if not self._pending_new and not self._pending_retired:
            return packed
        new_slots = {**self._pending_new, **packed.new_slots}
        retired = self._pending_retired + packed.retired
        self._pending_new, self._pending_retired = {}, ()
        return Packed(packed.structure, packed.slot, packed.layout, new_slots, retired)

    def _take(self, nbytes: int) -> tuple[int, dict[int, torch.UntypedStorage], tuple[int, ...]]:
        while not self._returned.empty():
            self._free.append(self._returned.get())
        for i, slot in enumerate(self._free):
            if self._slots[slot].numel() >= nbytes:
                return self._free.pop(i), {}, ()
        # No free slot is large enough: retire one too small (if any) and make a new one.
        retired: tuple[int, ...] = ()
        if self._free:
            old = self._free.pop(0)
            del self._slots[old]
            retired = (old,)
        size = max(_MIN_SLOT_BYTES, nbytes + nbytes // 4)
        storage = torch.UntypedStorage._new_shared(size)
        slot = self._next_id
        self._next_id += 1
        self._slots[slot] = torch.empty(0, dtype=torch.uint8).set_(storage)
        return slot, {slot: storage}, retired


class SlotReader:
    """Loader side: the slots of every worker, and unpacking of their batches.

    Slots go home from two threads: the receiver thread (`unpack`, and `give_back_freed` while
    it waits for results) and the training thread (`give_back_freed` at the start of each
    `ProcessPool.get`). The latter is what keeps a worker at three slots: a batch the training
    loop dropped goes back before the loop waits for its next one, instead of when the next
    result wakes the receiver, which is the moment that result's worker wants a slot for its
    next batch (and made a fourth, 2.4 MB of shared memory more per worker, measured: 4 and 3
    slots after 200 batches, now 3 and 3). A lock keeps the lending counts and the pipes'
    closing (`clear`) consistent between the two."""

    def __init__(self, returns: list[Any], lend_per_worker: int | None = None) -> None:
        self._returns = returns  # per worker: where to give slot ids back
        self._slots: dict[tuple[int, int], np.ndarray] = {}  # flat uint8 view of each slot
        self._lend_per_worker = LEND_PER_WORKER if lend_per_worker is None else lend_per_worker
        self._lent = [0] * len(returns)  # per worker: slots whose tensors the user holds
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def unpack(self, worker: int, packed: Packed, wanted: bool) -> Any:
        """The batch, or None when not `wanted` (a discarded task). Its tensors are views of
        the slot (lent until they are all gone) or, past the lending limit, copies (the slot
        goes back at once)."""
        for slot, storage in packed.new_slots.items():
            self._slots[worker, slot] = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        for slot in packed.retired:
            self._slots.pop((worker, slot), None)
        self.give_back_freed()
        if packed.slot is None:
            return packed.structure if wanted else None
        if not wanted:
            self._send(worker, packed.slot)
            return None
        buffer = self._slots[worker, packed.slot]
        if self._lent[worker] < self._lend_per_worker:
            return _restore(packed.structure, self._lend(worker, packed, buffer))
        try:
            return _restore(packed.structure, _copied(packed.layout, buffer))
        finally:
            self._send(worker, packed.slot)

    def _send(self, worker: int, slot: int) -> None:
        """Give `slot` back to `worker`."""
        with self._lock:
            self._write(worker, slot)

    def _write(self, worker: int, slot: int) -> None:
        """One atomic pipe write (see `shardloader.loader.workers.frames`); nothing once closed. The
        caller holds the lock, so that `clear` never closes the pipes between the check and
        the write."""
        if not self._closed:
            os.write(self._returns[worker]._writer.fileno(), frame(slot))

    def _lend(self, worker: int, packed: Packed, buffer: np.ndarray) -> list[torch.Tensor]:
        """The batch's tensors as views of the slot, each with a storage of exactly its bytes.

        They are made from slices of one memoryview of one numpy view of the slot: every slice
        keeps that numpy view alive, so its finalizer runs once, when the last tensor (or
        anything made from one) is gone, in whichever thread drops it (the training thread,
        the garbage collector). It only appends to a deque (thread-safe, never blocks);
        `give_back_freed` sends the slot home."""
        spans = [(start, math.prod(shape) * dtype.itemsize) for start, shape, dtype in packed.layout]
        used = [(start, nbytes) for start, nbytes in spans if nbytes]
        if not used:  # only empty tensors: nothing lies in the slot
            self._send(worker, packed.slot)
            return [torch.empty(shape, dtype=dtype) for _, shape, dtype in packed.layout]
        low = min(start for start, _ in used)
        lent = buffer[low:max(start + nbytes for start, nbytes in used)]
        whole = memoryview(lent)
        tensors = []
        for (start, nbytes), (_, shape, dtype) in zip(spans, packed.layout):
            if nbytes == 0:
                tensors.append(torch.empty(shape, dtype=dtype))
            else:
                part = whole[start - low:start - low + nbytes]
                tensors.append(torch.frombuffer(part, dtype=dtype).view(shape))
        with self._lock:
            self._lent[worker] += 1
        weakref.finalize(lent, self._freed.append, (worker, packed.slot)).atexit = False
        return tensors

    def give_back_freed(self) -> None:
        """Send the slots whose tensors are all gone back to their workers (either thread).

        Under the lock throughout: when it returns, every slot freed before the call is in its
        worker's pipe, also one the other thread had taken off the deque and was still sending.
        So a task submitted after it finds the slot there (one worker's three slots rely on it)."""
        with self._lock:
            while self._freed:
                worker, slot = self._freed.popleft()
                self._lent[worker] -= 1
                self._write(worker, slot)

    def clear(self) -> None:
        """Forget the slots and send nothing more (the pool is closing; call it before the
        pipes close). Tensors still lent keep their memory."""
        with self._lock:
            self._closed = True
        self._slots.clear()


def _copied(layout: tuple[tuple[int, tuple[int, ...], torch.dtype], ...],
            buffer: np.ndarray) -> list[torch.Tensor]:
    """The layout's tensors copied out of the slot into private memory."""
    tensors = []
    for start, shape, dtype in layout:
        out = torch.empty(shape, dtype=dtype)
        if out.numel():
            target = _bytes_of(out)
            np.copyto(target, buffer[start:start + target.size])
        tensors.append(out)
    return tensors
