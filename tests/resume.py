"""The tests' one equality and exact-resume helper: every test that compares samples, batches
or resumed runs calls it, so that "the same" means one thing everywhere — exactly the same.

`assert_identical(a, b)` compares two values exactly: container types, dict keys in order,
tensors' and arrays' dtypes, shapes and bytes, plain values by type and value; its message
names the field that differs. `assert_same_samples` does so for lists of records.

`assert_exact_resume(make_loader, total_batches, cuts)` runs an uninterrupted reference and
records every batch (its sample indices and the bytes of every tensor, bit for bit); then, for each
resume plan, consumes up to a cut, takes `state_dict()`, sends it through JSON (state must be
a small plain dict), builds a fresh loader, loads the state and continues. The concatenation
of all segments must equal the reference exactly: same samples, same order, same bytes.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RecordedBatch:
    """What a batch was, exactly: sample indices and every field's bytes, dtype and shape."""

    indices: tuple[int, ...]
    fields: tuple[tuple[str, str, tuple[int, ...], bytes], ...]

    def describe(self) -> str:
        return f"indices={list(self.indices)[:8]}{'...' if len(self.indices) > 8 else ''}"


def record(batch: Any, indices: Any = None) -> RecordedBatch:
    """Freeze a batch into comparable bytes: a dict from a shardloader.Dataset (its indices in
    `__index__`), or any batch (a list of columns from tuple samples, a dict without
    `__index__`) with its sample indices given (the Loader's `last_indices`)."""
    if indices is None:
        if not isinstance(batch, dict) or "__index__" not in batch:
            raise TypeError(f"a {type(batch).__name__} batch without __index__ needs its indices")
        indices = batch["__index__"]
    indices = tuple(int(i) for i in np.asarray(indices).tolist())
    fields: list[tuple[str, str, tuple[int, ...], bytes]] = []
    _freeze("", batch, fields)
    return RecordedBatch(indices, tuple(fields))


def _freeze(name: str, value: Any, fields: list[tuple[str, str, tuple[int, ...], bytes]]) -> None:
    """Append (name, dtype, shape, bytes) for `value`, recursing into dicts and lists/tuples of
    tensors (a batch's columns); a list of plain values is one field (its repr)."""
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().contiguous()
        fields.append((name, str(array.dtype), tuple(array.shape), array.numpy().tobytes()))
    elif isinstance(value, np.ndarray):
        fields.append((name, str(value.dtype), value.shape, value.tobytes()))
    elif isinstance(value, dict):
        for key in sorted(value):
            _freeze(f"{name}.{key}" if name else str(key), value[key], fields)
    elif isinstance(value, (list, tuple)):
        if any(isinstance(v, (torch.Tensor, np.ndarray, dict, list, tuple)) for v in value):
            fields.append((name, type(value).__name__, (len(value),), b""))
            for i, v in enumerate(value):
                _freeze(f"{name}.{i}" if name else str(i), v, fields)
        else:
            fields.append((name, "list", (len(value),), repr(list(value)).encode()))
    else:
        fields.append((name, type(value).__name__, (), repr(value).encode()))


def stream(loader: Any) -> Iterator[RecordedBatch]:
    """The loader's batches, recorded, crossing epoch boundaries by iterating it again when a
    pass ends. Taking from one stream continues where the last take stopped (a new `iter()`
    would start the epoch over, as DataLoader's does).

    One pass may yield nothing: the first after loading a state saved on an epoch's last batch
    (that epoch's loop is empty, then the next epoch starts). Two empty passes in a row fail."""
    empty_passes = 0
    while True:
        received = 0
        for batch in loader:
            has_index = isinstance(batch, dict) and "__index__" in batch
            yield record(batch, None if has_index else loader.last_indices)
            received += 1
        empty_passes = empty_passes + 1 if received == 0 else 0
        if empty_passes > 1:
            raise AssertionError("loader produced no batch in two passes in a row")


def take(loader: Any, count: int) -> list[RecordedBatch]:
    """Consume `count` batches of a new iteration (see `stream`), stopping right after the last
    one (the loop over its epoch is left, as a `break` leaves it)."""
    return list(itertools.islice(stream(loader), count))


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state must survive JSON unchanged: it is a small plain dict."""
    text = json.dumps(state)
    assert len(text) < 4096, f"state is {len(text)} bytes; resume state must stay small"
    restored = json.loads(text)
    assert restored == state
    return restored


def assert_same_batches(actual: Sequence[RecordedBatch], expected: Sequence[RecordedBatch], what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} batches, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.indices != e.indices:
            raise AssertionError(f"{what}: batch {i} has {a.describe()}, expected {e.describe()}")
        if a.fields != e.fields:
            names = [f[0] for f in a.fields if f not in e.fields]
            raise AssertionError(f"{what}: batch {i} has the right samples but different bytes in {names}")


def assert_exact_resume(
    make_loader: Callable[[], Any],
    total_batches: int,
    plans: Iterable[Sequence[int]],
    *,
    make_resumed: Callable[[int], Any] | None = None,
    reference: Sequence[RecordedBatch] | None = None,
) -> list[RecordedBatch]:
    """Check that every resume plan reproduces the uninterrupted run.

    A plan is a list of cut points (batch counts, increasing): the run stops at each cut, saves
    state, and a fresh loader continues. `make_resumed(segment)` builds the loader for segment
    1, 2, ... (default `make_loader`), e.g. with another `num_workers`.
    """
    if reference is None:
        loader = make_loader()
        reference = take(loader, total_batches)
        _close(loader)
    for plan in plans:
        cuts = list(plan) + [total_batches]
        assert cuts == sorted(cuts), f"cuts must increase: {plan}"
        loader = make_loader()
        got: list[RecordedBatch] = []
        done = 0
        for segment, cut in enumerate(cuts):
            got.extend(take(loader, cut - done) if cut > done else [])
            done = cut
            if segment == len(cuts) - 1:
                break
            state = plain_state(loader.state_dict())
            _close(loader)
            loader = (make_resumed or (lambda _s: make_loader()))(segment + 1)
            loader.load_state_dict(state)
        _close(loader)
        assert_same_batches(got, reference, f"resume plan {list(plan)}")
    return list(reference)


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if close is not None:
        close()


def epoch_loop(loader: Any, start: int, epochs: int, *,
               stop_after: int | None = None) -> tuple[list[RecordedBatch], int]:
    """Run the loop users write — `for epoch in range(start, epochs): loader.set_epoch(epoch);
    for batch in loader:` — recording every batch. `stop_after`: break out of both loops after
    that many batches (before the epoch's next batch is asked for). Returns (batches, the loop's
    epoch when it stopped): the epoch a user would save with the loader's state."""
    out: list[RecordedBatch] = []
    epoch = start
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            out.append(record(batch))
            if stop_after is not None and len(out) == stop_after:
                return out, epoch
    return out, epoch


def assert_exact_epoch_loop_resume(
    make_loader: Callable[[], Any],
    epochs: int,
    stop_after: int,
    start: Callable[[int, Any], int],
    *,
    reference: Sequence[RecordedBatch] | None = None,
) -> list[RecordedBatch]:
    """The epoch loop stopped after `stop_after` batches, its state saved (through JSON) with
    the loop's epoch, and resumed by a fresh loader with the loop starting at
    `start(saved_epoch, resumed_loader)`, gives exactly the uninterrupted loop's batches.
    Whatever the loader raises (e.g. StateError for a loop that would replay) propagates."""
    if reference is None:
        loader = make_loader()
        reference, _ = epoch_loop(loader, 0, epochs)
        _close(loader)
    loader = make_loader()
    first, saved_epoch = epoch_loop(loader, 0, epochs, stop_after=stop_after)
    state = plain_state(loader.state_dict())
    _close(loader)
    resumed = make_loader()
    try:
        resumed.load_state_dict(state)
        rest, _ = epoch_loop(resumed, start(saved_epoch, resumed), epochs)
    finally:
        _close(resumed)
    assert_same_batches(first + rest, reference, f"epoch loop stopped after {stop_after} batches")
    return list(reference)


def assert_identical(a: Any, b: Any, path: str = "batch", *, key_order: bool = True,
                     writeable: bool = False) -> None:
    """`a` and `b` are the same value: container types, dict keys (in order, unless not
    `key_order`: for records of readers that order their fields differently), tensors' and
    numpy arrays' dtypes, shapes and bytes (and arrays' writeable flag, when `writeable`), and
    plain values (bytes, str, numbers, numpy scalars) of the same type and equal. The message
    names the first field that differs, by its `path`."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert _tensor_bytes(a) == _tensor_bytes(b), f"{path}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if writeable:
            assert a.flags.writeable == b.flags.writeable, (
                f"{path}: writeable {a.flags.writeable} vs {b.flags.writeable}")
        assert a.tobytes() == b.tobytes(), f"{path}: bytes differ"
    elif isinstance(a, dict):
        if key_order:
            assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        else:
            assert a.keys() == b.keys(), (
                f"{path}: keys {list(a.keys() - b.keys())} only in the first, "
                f"{list(b.keys() - a.keys())} only in the second")
        for k in a:
            assert_identical(a[k], b[k], f"{path}[{k!r}]", key_order=key_order, writeable=writeable)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]", key_order=key_order, writeable=writeable)
    else:
        assert a == b, f"{path}: {_show(a)} vs {_show(b)}"


def assert_same_samples(actual: Sequence[dict[str, Any]], expected: Sequence[dict[str, Any]],
                        what: str = "sample", *, skip: Iterable[str] = (), key_order: bool = True,
                        writeable: bool = False) -> None:
    """`actual` holds exactly the records of `expected`, in order (`assert_identical` for each),
    leaving out the fields in `skip` (e.g. the `__index__` a Dataset adds) on both sides."""
    skipped = set(skip)
    assert len(actual) == len(expected), f"{what}s: {len(actual)} records, expected {len(expected)}"
    for i, (got, want) in enumerate(zip(actual, expected)):
        assert_identical({k: v for k, v in got.items() if k not in skipped},
                         {k: v for k, v in want.items() if k not in skipped},
                         f"{what} {i}", key_order=key_order, writeable=writeable)


def _show(value: Any) -> str:
    """A value for a failure message: its repr, cut short (a sample's bytes can be large)."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:100]}... ({len(text)} characters)"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of `t`, for any dtype (bfloat16 has no numpy twin)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
