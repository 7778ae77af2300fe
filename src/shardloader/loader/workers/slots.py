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
read it; the worker makes another slot meanwhile (it never waits). Each storage of the batch
comes back as a storage of exactly the bytes its tensors use (`torch.save` of a label writes
the label, not the slot). A
worker lends at most `LEND_PER_WORKER` slots at once; beyond that (a script that keeps every
batch) the batch is copied out into private memory and its slot given back at once, so
slots, their memory and their file descriptors stay bounded. A worker creates slots only as it
needs them: prefetch_factor + 1 with a loop that drops each batch (its batches in flight and the
one the loop holds), and one that waits for its next task unmaps their pages from its own memory
(`_PageAdvice`: the bytes stay in shared memory for the loader).

Why not copy always (as before): the copy was the training process's largest cost per batch,
about 13 us per 112 px sample (a 2.4 MB memcpy into fresh pages, on the receiver thread, which
competes with the training thread for the GIL and with the workers for the cores), and the
copies' freed memory stayed in glibc's heap.

Exactness: tensors travel byte for byte, with their dtype, shape, strides and the views
they share, in any nesting of dicts, lists, tuples and namedtuples
(`shardloader.loader.workers.structure`). Anything else (numpy arrays, strings, tensors that
need grad, sparse, quantized or nested ones, ...) stays in the structure and is pickled with
it, and a batch the slots cannot take apart at all travels pickled whole: never an error.
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

from shardloader.format.mapped import MADV_DONTNEED, madvise
from shardloader.loader.workers.frames import frame
from shardloader.loader.workers.structure import (
    Span,
    TensorSpec,
    build,
    extract,
    plan_spans,
    restore,
)

_ALIGN = 64
_MIN_SLOT_BYTES = 1 << 20
#: Slots of one worker lent at once (see the module's docstring), at least: batches waiting to
#: be taken count too, so a pool lends `prefetch_factor + 2` when that is more. A training loop
#: holds one or two batches; more than this means batches are being kept.
LEND_PER_WORKER = 4
#: Room `allocate` leaves after the reserved tensor for the batch's other tensors (labels...).
_RESERVE_EXTRA = 64 << 10
#: madvise(2) advice (Linux >= 5.14; EINVAL before): map a range's pages writable in one call.
_MADV_POPULATE_WRITE = 23


class _PageAdvice:
    """madvise(2) on this process's mapping of a slot, where libc has it (else nothing).

    Why an idle worker unmaps its slots' pages (`SlotWriter.idle`): a worker cycles through
    prefetch_factor + 1 slots (the one it writes, its batches waiting in the loader, the one
    the training loop holds), and every page it wrote stays in its RSS, 2.3 MiB per slot of 64
    112 px images: with prefetch_factor 2, 6.9 MiB per worker, where DataLoader's worker maps
    only the batch it is making (the batches it sent are mapped by no process until the
    training process takes them). The bytes stay in the shared-memory object (the loader's
    mapping reads them); taking a slot again maps its pages in one `MADV_POPULATE_WRITE` call
    instead of a fault per page as they are written (2.4 MB on the 2-core VM: 0.46 ms against
    0.72-0.85 ms), and no page is ever zero-filled again, as DataLoader's shared-memory copy
    of each batch is.

    Only while idle, because it is not free: unmapping and mapping again cost a busy worker
    about 0.6 ms per batch, 6% more CPU per sample measured (benchmarks/memory.py's work, A/B
    in alternating fresh processes). A worker with its next task already queued keeps its
    pages (the loader is waiting for it: throughput is what matters there); one that waits for
    the training loop (the usual case in training, the step longer than a batch's making) has
    the time."""

    def __init__(self) -> None:
        self._madvise: Any = madvise  # libc's, as `shardloader.format.mapped` loads it
        self._populate = True

    def release(self, slot: torch.Tensor) -> None:
        """Drop this process's mapping of the slot's pages (the shared bytes stay)."""
        if self._madvise is not None and slot.numel():
            self._madvise(slot.data_ptr(), slot.numel(), MADV_DONTNEED)

    def populate(self, slot: torch.Tensor, nbytes: int) -> None:
        """Map the first `nbytes` of the slot writable now, in one call (a kernel without
        MADV_POPULATE_WRITE: the pages fault in as they are written instead)."""
        if self._madvise is None or not self._populate or nbytes <= 0:
            return
        if self._madvise(slot.data_ptr(), min(nbytes, slot.numel()), _MADV_POPULATE_WRITE) != 0:
            self._populate = False  # EINVAL (an older kernel): never ask again


@dataclass(frozen=True)
class Packed:
    """A batch on its way to the loader: structure with TensorRefs, and where they lie."""

    structure: Any
    slot: int | None  # None: no bytes travelled through a slot
    spans: tuple[tuple[int, int], ...]  # per storage: (offset in the slot, nbytes)
    layout: tuple[TensorSpec, ...]  # per tensor: where in which span (see `structure`)
    new_slots: dict[int, torch.UntypedStorage]
    retired: tuple[int, ...]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _storage_bytes(storage: torch.UntypedStorage) -> np.ndarray:
    """The storage's bytes as a flat uint8 numpy view."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


#: What `allocate` (or `allocate_many`) reserved: (slot, the tensor(s) made there, its new
#: storage and retired ids).
_Reservation = tuple[int, Any, dict[int, torch.UntypedStorage], tuple[int, ...]]


class SlotWriter:
    """Worker side: packs batches into this worker's slots. `returned` yields slot ids the
    loader has finished with (checked before every batch, never waited on)."""

    def __init__(self, returned: Any) -> None:
        self._returned = returned
        self._slots: dict[int, torch.Tensor] = {}  # id -> flat uint8 tensor on the storage
        self._free: list[int] = []
        self._next_id = 0
        # allocate(): (slot, tensor made there, its new storage and retired ids, if any)
        self._reserved: _Reservation | None = None
        # from reservations given back unused: still to be sent with the next batch
        self._pending_new: dict[int, torch.UntypedStorage] = {}
        self._pending_retired: tuple[int, ...] = ()
        self._pages = _PageAdvice()
        # slots whose pages this process has unmapped (`idle`): mapped again when taken
        self._released: set[int] = set()

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

    def allocate_many(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Uninitialised contiguous tensors of these (shape, dtype)s, one after the other in one
        free slot, for the producer to collate a batch into (`shardloader.loader.collate.
        BatchBuilder`): `pack` then finds each where it is and copies none of them.

        Each tensor has a storage of its own (a numpy view of its bytes of the slot, as
        `torch.from_numpy` makes it), so that the batch's tensors travel as separate spans and
        come back on separate storages of exactly their bytes, as collate's private tensors
        would. Like `allocate`, a reservation the next `pack` does not use goes back."""
        self._release_reserved()
        sizes = [_aligned(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
                 for shape, dtype in specs]
        slot, new_slots, retired = self._take(sum(sizes) + _RESERVE_EXTRA)
        flat = self._slots[slot].numpy()
        tensors, offset = [], 0
        for (shape, dtype), nbytes in zip(specs, sizes):
            count = math.prod(shape)
            size = count * torch.empty((), dtype=dtype).element_size()
            tensors.append(torch.from_numpy(flat[offset:offset + size]).view(dtype)[:count].view(shape))
            offset += nbytes
        self._reserved = (slot, tensors, new_slots, retired)
        return tensors

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
        """`batch` for the loader: its tensors' bytes in a slot, the rest in the structure.
        A batch the slots cannot take apart (a structure that refers to itself, say) travels
        whole, pickled."""
        reserved, self._reserved = self._reserved, None
        tensors: list[torch.Tensor] = []
        try:
            structure = extract(batch, tensors)
            spans, specs = plan_spans(tensors)
        except Exception:  # noqa: BLE001 - never fail a batch over its transport
            structure, spans, specs = batch, [], []
        return self._with_pending(self._place(structure, spans, specs, reserved))

    def _place(self, structure: Any, spans: list[Span], specs: list[TensorSpec],
               reserved: _Reservation | None) -> Packed:
        """The spans copied into a slot (the reserved one where they fit after what was
        built in it), and the Packed that says where."""
        # Spans in the reserved slot's memory (the tensors `allocate` or `allocate_many` made,
        # and views of them) lie in it already, where they are: they stay there, the rest goes
        # after them. `inside`: each span's offset in the slot, or None.
        inside = self._inside(spans, reserved)
        placed = [offset is not None for offset in inside]
        if reserved is not None and not any(placed):  # not in this batch: the slot is free again
            self._reserved = reserved
            self._release_reserved()
            reserved = None
        if not spans:  # no tensor has bytes: nothing needs a slot
            return Packed(structure, None, (), tuple(specs), {}, ())
        offsets, end = self._offsets(spans, inside)
        if reserved is not None and self._slots[reserved[0]].numel() >= end:
            slot, new_slots, retired = reserved[0], reserved[2], reserved[3]
        else:
            if reserved is not None:  # the rest does not fit after it: copy all into a larger slot
                self._reserved = reserved
                self._release_reserved()
                placed = [False] * len(spans)
                offsets, end = self._offsets(spans, [None] * len(spans))
            slot, new_slots, retired = self._take(end)
        buffer = self._slots[slot].numpy()
        for span, offset, in_place in zip(spans, offsets, placed):
            if not in_place:
                source = _storage_bytes(span.storage)[span.start:span.start + span.nbytes]
                buffer[offset:offset + span.nbytes] = source
        where = tuple((offset, span.nbytes) for offset, span in zip(offsets, spans))
        return Packed(structure, slot, where, tuple(specs), new_slots, retired)

    def _inside(self, spans: list[Span], reserved: _Reservation | None) -> list[int | None]:
        """For each span, its offset in the reserved slot if its bytes lie there, else None."""
        if reserved is None:
            return [None] * len(spans)
        slot = self._slots[reserved[0]]
        base, size = slot.data_ptr(), slot.numel()
        inside: list[int | None] = []
        for span in spans:
            offset = span.storage.data_ptr() - base + span.start
            inside.append(offset if 0 <= offset and offset + span.nbytes <= size else None)
        return inside

    @staticmethod
    def _offsets(spans: list[Span], inside: list[int | None]) -> tuple[list[int], int]:
        """Where each span goes in the slot (those `inside` it where they are), and the bytes
        used."""
        end = max((_aligned(o + s.nbytes) for s, o in zip(spans, inside) if o is not None), default=0)
        offsets = []
        for span, offset in zip(spans, inside):
            if offset is not None:
                offsets.append(offset)
            else:
                offsets.append(end)
                end += _aligned(span.nbytes)
        return offsets, end

    def idle(self) -> None:
        """The worker has no task to do: let go of every slot's pages in this process (see
        `_PageAdvice`); the bytes stay in shared memory for the loader, and `_take` maps a
        slot again when it is reused."""
        for slot, flat in self._slots.items():
            if slot not in self._released:
                self._pages.release(flat)
                self._released.add(slot)

    def unsent(self, packed: Packed) -> None:
        """`packed` could not be sent (its structure does not pickle): its slot is free again,
        and the slots it made or retired go with the next batch."""
        if packed.slot is not None:
            self._free.append(packed.slot)
        self._pending_new.update(packed.new_slots)
        self._pending_retired += packed.retired

    def _with_pending(self, packed: Packed) -> Packed:
        """`packed` carrying also the slots made (or retired) by reservations never used."""
        if not self._pending_new and not self._pending_retired:
            return packed
        new_slots = {**self._pending_new, **packed.new_slots}
        retired = self._pending_retired + packed.retired
        self._pending_new, self._pending_retired = {}, ()
        return Packed(packed.structure, packed.slot, packed.spans, packed.layout, new_slots, retired)

    def _take(self, nbytes: int) -> tuple[int, dict[int, torch.UntypedStorage], tuple[int, ...]]:
        while not self._returned.empty():
            self._free.append(self._returned.get())
        for i, slot in enumerate(self._free):
            if self._slots[slot].numel() >= nbytes:
                if slot in self._released:
                    self._released.discard(slot)
                    self._pages.populate(self._slots[slot], nbytes)
                return self._free.pop(i), {}, ()
        # No free slot is large enough: retire one too small (if any) and make a new one.
        retired: tuple[int, ...] = ()
        if self._free:
            old = self._free.pop(0)
            del self._slots[old]
            self._released.discard(old)
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
        if packed.slot is None:  # no bytes in a slot (zero-size tensors at most)
            if not wanted:
                return None
            if not packed.layout:
                return packed.structure
            return restore(packed.structure, build(packed.layout, []))
        if not wanted:
            self._send(worker, packed.slot)
            return None
        buffer = self._slots[worker, packed.slot]
        if self._lent[worker] < self._lend_per_worker:
            return restore(packed.structure, build(packed.layout, self._lend(worker, packed, buffer)))
        try:
            return restore(packed.structure, build(packed.layout, _copied(packed.spans, buffer)))
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
        """The batch's spans as views of the slot: one flat uint8 tensor per span, each with a
        storage of exactly its bytes (the batch's tensors are then made on them).

        They are made from slices of one memoryview of one numpy view of the slot: every slice
        keeps that numpy view alive, so its finalizer runs once, when the last tensor (or
        anything made from one) is gone, in whichever thread drops it (the training thread,
        the garbage collector). It only appends to a deque (thread-safe, never blocks);
        `give_back_freed` sends the slot home."""
        low = min(start for start, _ in packed.spans)
        lent = buffer[low:max(start + nbytes for start, nbytes in packed.spans)]
        whole = memoryview(lent)
        bases = [torch.frombuffer(whole[start - low:start - low + nbytes], dtype=torch.uint8)
                 for start, nbytes in packed.spans]
        with self._lock:
            self._lent[worker] += 1
        weakref.finalize(lent, self._freed.append, (worker, packed.slot)).atexit = False
        return bases

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


def _copied(spans: tuple[tuple[int, int], ...], buffer: np.ndarray) -> list[torch.Tensor]:
    """The spans copied out of the slot into private memory (flat uint8 tensors)."""
    bases = []
    for start, nbytes in spans:
        base = torch.empty(nbytes, dtype=torch.uint8)
        np.copyto(base.numpy(), buffer[start:start + nbytes])
        bases.append(base)
    return bases
