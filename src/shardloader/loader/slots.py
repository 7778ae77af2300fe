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

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_ALIGN = 64
_MIN_SLOT_BYTES = 1 << 20
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

    def pack(self, batch: Any) -> Packed:
        tensors: list[torch.Tensor] = []
        structure = _extract(batch, tensors)
        if not tensors:
            return Packed(batch, None, (), {}, ())
        tensors = [t.contiguous() for t in tensors]
        layout = []
        offset = 0
        for t in tensors:
            layout.append((offset, tuple(t.shape), t.dtype))
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        slot, new_slots, retired = self._take(offset)
        buffer = self._slots[slot].numpy()
        for (start, _, _), t in zip(layout, tensors):
            if t.numel():
                data = _bytes_of(t)
                buffer[start:start + data.size] = data
        return Packed(structure, slot, tuple(layout), new_slots, retired)

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
