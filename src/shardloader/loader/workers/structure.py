"""A batch taken apart for the slots (`shardloader.loader.workers.slots`): its structure with
each tensor replaced by a `TensorRef`, and the bytes those tensors need.

What is taken apart: dicts, lists, tuples, namedtuples, `OrderedDict` and `defaultdict`, to
any depth, and in them every plain CPU tensor (`carried`: any dtype but the quantized ones,
strided, not needing grad, no conjugate or negative bit, not a nested tensor or a subclass).
Everything else (numpy arrays, strings, other containers, the tensors that are not plain)
stays in the structure and is pickled with it, as DataLoader's queue pickles it.

Tensors travel as their storage's bytes, so a batch comes back as the worker made it: same
dtypes, shapes, strides, storage offsets, and views of one storage in the batch are views of
one storage again (`x`, `x[2:5]`, `x.t()`, an `expand`), as DataLoader's shared-memory
transport gives them. Each storage sends the byte range its tensors touch (a `Span`), but
never much more than they hold: rows picked far apart from a large tensor the dataset keeps
go in separate spans (and come back on separate storages), and one column of a wide matrix
is made contiguous first. The same values, a compact copy instead of the whole storage.
(DataLoader moves such a storage into shared memory whole, the dataset's own tensor included.)
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import torch

#: The largest element size: span starts are multiples of it, so every tensor's offset in
#: its span is a whole number of its elements.
_SPAN_ALIGN = 16
#: A span may hold up to twice the bytes of its tensors, plus this much.
_SPAN_SLACK = 4096
#: (span index, or -1 for a tensor without bytes; element offset in the span; shape; stride;
#: dtype)
TensorSpec = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]

#: A tensor on a storage: (its first byte there, its last byte + 1, its index in the batch).
_Member = tuple[int, int, int]


class TensorRef(NamedTuple):
    """Stands in the structure for tensor `index` of the batch. (Named tuples, not frozen
    dataclasses: a batch makes several, and these cost a fifth to make.)"""

    index: int


class Span(NamedTuple):
    """Bytes [start, start + nbytes) of `storage`: what the batch's tensors on it need."""

    storage: torch.UntypedStorage
    start: int
    nbytes: int


def carried(value: Any) -> bool:
    """Whether `value` is a tensor the slots carry as bytes (see the module's docstring)."""
    return (type(value) is torch.Tensor and value.is_cpu
            and value.layout == torch.strided and not value.is_nested and not value.is_quantized
            and not value.requires_grad and not value.is_conj() and not value.is_neg())


def _is_namedtuple(kind: type) -> bool:
    """A class made by `collections.namedtuple` or `typing.NamedTuple` (not a subclass of one,
    which may carry more than its fields)."""
    return kind.__bases__ == (tuple,) and isinstance(kind.__dict__.get("_fields"), tuple)


def extract(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each carried tensor appended to `tensors` and replaced by its TensorRef."""
    if carried(value):
        tensors.append(value)
        return TensorRef(len(tensors) - 1)
    return _rebuild(value, extract, tensors)


def restore(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The batch again: each TensorRef in `value` replaced by its tensor."""
    if type(value) is TensorRef:
        return tensors[value.index]
    return _rebuild(value, restore, tensors)


def _rebuild(value: Any, walk: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with `walk` applied to what it contains, when it is a container we walk."""
    kind = type(value)
    if kind is dict:
        return {k: walk(v, tensors) for k, v in value.items()}
    if kind is list:
        return [walk(v, tensors) for v in value]
    if kind is tuple:
        return tuple([walk(v, tensors) for v in value])
    if kind is collections.OrderedDict:
        return collections.OrderedDict([(k, walk(v, tensors)) for k, v in value.items()])
    if kind is collections.defaultdict:
        items = ((k, walk(v, tensors)) for k, v in value.items())
        return collections.defaultdict(value.default_factory, items)
    if issubclass(kind, tuple) and _is_namedtuple(kind):
        return kind._make(walk(v, tensors) for v in value)
    return value


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage `tensor` (not empty) touches: [first, last + 1)."""
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    if tensor.is_contiguous():
        return first, first + tensor.numel() * size
    extent = sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride()))
    return first, first + (extent + 1) * size


def plan_spans(tensors: list[torch.Tensor]) -> tuple[list[Span], list[TensorSpec]]:
    """The spans that carry `tensors`, and where each tensor lies in them.

    Per storage, its tensors in the order of their first byte are gathered into runs, each run
    one span, as long as the span stays within `_fits` of what the run holds. A tensor that
    alone touches far more than it holds (one column of a wide matrix) is replaced in `tensors`
    by a contiguous copy first."""
    specs: list[TensorSpec | None] = [None] * len(tensors)
    by_storage: dict[tuple[int, int], tuple[torch.UntypedStorage, list[_Member]]] = {}
    for i, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            specs[i] = (-1, 0, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            continue
        first, last = _byte_range(tensor)
        if last - first > _own_bytes(tensor) and not _fits(first, last, _own_bytes(tensor)):
            tensors[i] = tensor = tensor.contiguous()
            first, last = _byte_range(tensor)
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        by_storage.setdefault(key, (storage, []))[1].append((first, last, i))
    spans: list[Span] = []
    for storage, members in by_storage.values():
        for run in (_runs(sorted(members), tensors) if len(members) > 1 else [members]):
            start = run[0][0] // _SPAN_ALIGN * _SPAN_ALIGN
            for first, _, i in run:
                t = tensors[i]
                specs[i] = (len(spans), (first - start) // t.element_size(), tuple(t.shape),
                            tuple(t.stride()), t.dtype)
            spans.append(Span(storage, start, max(last for _, last, _ in run) - start))
    return spans, specs  # type: ignore[return-value] - every spec is set above


def _own_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _fits(first: int, last: int, own: int) -> bool:
    """Whether sending bytes [first, last) costs at most about twice the `own` bytes they hold."""
    return last - first // _SPAN_ALIGN * _SPAN_ALIGN <= 2 * own + _SPAN_SLACK


def _runs(members: list[_Member], tensors: list[torch.Tensor]) -> list[list[_Member]]:
    """`members` of one storage (sorted), in runs whose span `_fits` what they hold."""
    runs: list[list[_Member]] = []
    first = last = own = 0
    for member in members:
        grown_last, grown_own = max(last, member[1]), own + _own_bytes(tensors[member[2]])
        if runs and _fits(first, grown_last, grown_own):
            runs[-1].append(member)
            last, own = grown_last, grown_own
        else:
            runs.append([member])
            first, last, own = member[0], member[1], _own_bytes(tensors[member[2]])
    return runs


def build(specs: tuple[TensorSpec, ...], bases: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of `specs`, on `bases` (one flat uint8 tensor per span, owning its bytes)."""
    tensors = []
    for span, offset, shape, stride, dtype in specs:
        if span < 0:
            tensors.append(torch.empty_strided(shape, stride, dtype=dtype))
        else:
            tensors.append(torch.empty(0, dtype=dtype).set_(bases[span].untyped_storage(), offset,
                                                             shape, stride))
    return tensors
