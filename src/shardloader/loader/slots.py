"""Moving batches from worker processes to the loader through reused shared-memory slots.

Sending a tensor through a torch.multiprocessing queue moves its storage into a new
shared-memory segment and passes the segment's file descriptor over a socket, with an
authenticated connection to the sending process per tensor. For a batch of 64 small images
that cost about as much CPU as decoding a tenth of the batch, on both sides, and every batch
faults in fresh pages. Here each worker owns a few shared-memory slots instead: it copies the
batch's tensors into a free slot and sends only the batch's structure (small) and where each
tensor lies; the loader copies the tensors out (one memcpy each; the batch it hands out is
ordinary private memory) and gives the slot back at once. A slot's descriptor crosses once,
when the worker creates it; the slots are reused for every later batch.

Exactness: tensors are copied byte for byte, with their dtype and shape. Anything that is not
a plain CPU tensor (numpy arrays, strings, tensors that need grad, sparse or quantized ones, ...)
stays in the structure and is pickled as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_ALIGN = 64
_MIN_SLOT_BYTES = 1 << 20
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
    """Loader side: the slots of every worker, and unpacking of their batches."""

    def __init__(self, returns: list[Any]) -> None:
        self._returns = returns  # per worker: where to give slot ids back
        self._slots: dict[tuple[int, int], torch.Tensor] = {}

    def unpack(self, worker: int, packed: Packed, wanted: bool) -> Any:
        """The batch (copied out of its slot), or None when not `wanted` (a discarded task);
        either way the slot goes back to its worker."""
        for slot, storage in packed.new_slots.items():
            self._slots[worker, slot] = torch.empty(0, dtype=torch.uint8).set_(storage)
        for slot in packed.retired:
            self._slots.pop((worker, slot), None)
        if packed.slot is None:
            return packed.structure if wanted else None
        try:
            if not wanted:
                return None
            buffer = self._slots[worker, packed.slot].numpy()
            tensors = []
            for start, shape, dtype in packed.layout:
                out = torch.empty(shape, dtype=dtype)
                if out.numel():
                    target = _bytes_of(out)
                    np.copyto(target, buffer[start:start + target.size])
                tensors.append(out)
            return _restore(packed.structure, tensors)
        finally:
            self._returns[worker].put(packed.slot)

    def clear(self) -> None:
        self._slots.clear()
