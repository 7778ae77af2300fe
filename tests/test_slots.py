"""Worker-to-loader batch transport through reused shared-memory slots: byte-exact, any
structure, slots reused and grown, never blocking a worker."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
import torch

from shardloader.loader.workers import slots
from shardloader.loader.workers.slots import SlotReader, SlotWriter
from tests.resume import assert_identical


@pytest.fixture()
def pair():
    returns = multiprocessing.get_context("fork").SimpleQueue()
    writer = SlotWriter(returns)
    reader = SlotReader([returns])
    yield writer, reader
    returns.close()


def _batch(n: int = 4):
    return {
        "image": torch.arange(n * 6 * 5 * 3, dtype=torch.int64).to(torch.uint8).view(n, 6, 5, 3),
        "label": torch.arange(n),
        "flags": torch.tensor([True, False] * (n // 2)),
        "bf16": torch.linspace(0, 1, n).to(torch.bfloat16),
        "c128": torch.arange(n, dtype=torch.float64) * 1j,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros((0, 7)),
        "strided": torch.arange(24.0).view(4, 6)[:, ::2],
        "names": [f"n{i}" for i in range(n)],
        "array": np.arange(n, dtype=np.float32),
        "nested": ({"t": torch.ones(2, 2)}, [torch.zeros(1, dtype=torch.int16), "x"]),
        "grad": torch.ones(2, requires_grad=True),
    }


def test_roundtrip_is_exact_for_any_structure(pair):
    writer, reader = pair
    batch = _batch()
    packed = writer.pack(batch)
    assert packed.slot is not None and packed.new_slots
    out = reader.unpack(0, packed, wanted=True)
    grad_in, grad_out = batch.pop("grad"), out.pop("grad")
    np.testing.assert_array_equal(out.pop("array"), batch.pop("array"))
    assert_identical(out, batch)
    assert grad_out.requires_grad and torch.equal(grad_out.detach(), grad_in.detach())


def test_a_lent_slot_is_not_reused_until_every_tensor_of_its_batch_is_gone(pair):
    writer, reader = pair
    first = reader.unpack(0, writer.pack({"x": torch.full((1000,), 1.0), "y": torch.arange(3)}),
                          wanted=True)
    kept = first["x"][10:20].numpy()  # a numpy view of a slice: still the slot's memory
    label = first["y"]
    del first
    reader.give_back_freed()
    packed = writer.pack({"x": torch.full((1000,), 2.0)})
    assert packed.slot == 1 and packed.new_slots  # slot 0 is still lent: a new one, no wait
    second = reader.unpack(0, packed, wanted=True)
    assert np.array_equal(kept, np.full(10, 1.0, dtype=np.float32))  # not overwritten
    assert torch.equal(label, torch.arange(3))
    del kept
    reader.give_back_freed()
    assert writer.pack({"x": torch.zeros(3)}).slot == 2  # slot 0 still lent (label), 1 too
    del label
    reader.give_back_freed()
    assert writer.pack({"x": torch.zeros(3)}).slot == 0  # every tensor gone: slot 0 is back
    assert torch.equal(second["x"], torch.full((1000,), 2.0))


def test_a_lent_tensor_has_its_own_storage_of_exactly_its_bytes(pair):
    writer, reader = pair
    batch = {"image": torch.zeros(64, 8, 8, 3, dtype=torch.uint8), "label": torch.arange(64)}
    out = reader.unpack(0, writer.pack(batch), wanted=True)
    assert out["label"].untyped_storage().nbytes() == 64 * 8  # not the whole slot
    assert out["image"].untyped_storage().nbytes() == 64 * 8 * 8 * 3
    assert_identical(out, batch)


def test_past_the_lending_limit_batches_are_copied_and_their_slots_come_back(pair):
    writer, reader = pair
    kept = [reader.unpack(0, writer.pack({"x": torch.full((7,), float(i))}), wanted=True)
            for i in range(slots.LEND_PER_WORKER)]
    assert writer.pack({"x": torch.zeros(1)}).slot == slots.LEND_PER_WORKER  # in flight
    packed = writer.pack({"x": torch.full((7,), 9.0)})
    assert packed.slot == slots.LEND_PER_WORKER + 1  # the previous one was never unpacked
    copied = reader.unpack(0, packed, wanted=True)  # the limit is reached: a private copy
    assert torch.equal(copied["x"], torch.full((7,), 9.0))
    assert copied["x"].untyped_storage().nbytes() == 7 * 4
    assert writer.pack({"x": torch.zeros(1)}).slot == slots.LEND_PER_WORKER + 1  # back at once
    for i, batch in enumerate(kept):
        assert torch.equal(batch["x"], torch.full((7,), float(i)))


def test_a_lent_batch_outlives_the_reader_and_its_worker(pair):
    """Tensors handed out stay valid after the pool is gone: they hold the slot's mapping."""
    writer, reader = pair
    batch = {"x": torch.arange(5000, dtype=torch.int32)}
    out = reader.unpack(0, writer.pack(batch), wanted=True)
    reader.clear()
    del writer
    assert_identical(out, batch)
    del out
    reader.give_back_freed()  # closed: nothing is sent


def test_a_larger_batch_gets_a_larger_slot_and_retires_the_small_one(pair):
    writer, reader = pair
    reader.unpack(0, writer.pack({"x": torch.zeros(10)}), wanted=True)  # dropped at once
    reader.give_back_freed()
    big = torch.arange(2_000_000, dtype=torch.int32)  # 8 MB, more than the first slot
    packed = writer.pack({"x": big})
    assert packed.retired == (0,) and list(packed.new_slots) == [1]
    assert torch.equal(reader.unpack(0, packed, wanted=True)["x"], big)
    assert len(reader._slots) == 1


def test_a_worker_never_waits_for_a_slot(pair):
    """Slots not yet given back: the worker makes another one instead of blocking."""
    writer, reader = pair
    packed = [writer.pack({"x": torch.full((5,), float(i))}) for i in range(3)]
    assert [p.slot for p in packed] == [0, 1, 2]
    for i, p in enumerate(packed):
        assert torch.equal(reader.unpack(0, p, wanted=True)["x"], torch.full((5,), float(i)))
    reader.give_back_freed()  # the batches were dropped: their slots go home
    assert writer.pack({"x": torch.zeros(5)}).slot == 0


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


def resident_bytes(tensor: torch.Tensor) -> int:
    """How much of this process's mapping that starts at `tensor`'s memory is in its page
    tables (the mapping's Rss in /proc/self/smaps)."""
    start = f"{tensor.data_ptr():x}-"
    with open("/proc/self/smaps") as f:
        lines = iter(f.read().splitlines())
    for line in lines:
        if line.startswith(start):
            for field in lines:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {start}")


def test_an_idle_writer_lets_go_of_its_slots_pages_and_the_bytes_stay(pair):
    """With nothing to do, the worker unmaps its slots' pages (its RSS keeps none of them); the
    bytes stay in shared memory for the loader, and a slot taken again is mapped in one call
    before it is written."""
    writer, reader = pair
    batch = {"x": torch.arange(1 << 18, dtype=torch.int32), "y": torch.arange(3)}  # 1 MiB
    packed = writer.pack(batch)
    slot = writer._slots[packed.slot]
    assert resident_bytes(slot) >= 1 << 20
    writer.idle()
    assert resident_bytes(slot) == 0
    out = reader.unpack(0, packed, wanted=True)
    assert_identical(out, batch)  # read back from the shared memory, byte for byte
    del out
    reader.give_back_freed()
    # Here reader and writer share one mapping, which that read mapped again: let go again.
    writer._pages.release(slot)
    assert resident_bytes(slot) == 0
    images = writer.allocate((1 << 20,), torch.uint8)  # the same slot, taken again
    assert images.data_ptr() == slot.data_ptr()
    if _kernel_at_least(5, 14):  # MADV_POPULATE_WRITE: mapped in one call, before written
        assert resident_bytes(slot) >= 1 << 20
    images.fill_(7)
    again = reader.unpack(0, writer.pack({"image": images}), wanted=True)
    assert torch.equal(again["image"], torch.full((1 << 20,), 7, dtype=torch.uint8))
    writer.idle()
    assert resident_bytes(slot) == 0  # and once more: released slots are tracked per use


def test_a_discarded_batch_still_gives_its_slot_back(pair):
    writer, reader = pair
    assert reader.unpack(0, writer.pack({"x": torch.ones(3)}), wanted=False) is None
    assert writer.pack({"x": torch.ones(3)}).slot == 0


def test_a_batch_without_tensors_travels_as_it_is(pair):
    writer, reader = pair
    packed = writer.pack(["a", 1, None])
    assert packed.slot is None
    assert reader.unpack(0, packed, wanted=True) == ["a", 1, None]


def _built_in_slot(writer, batch_size=4):
    """A batch whose image tensor was built where `allocate` put it, as the direct path does."""
    images = writer.allocate((batch_size, 6, 5, 3), torch.uint8)
    expected = {k: v for k, v in _batch(batch_size).items() if k not in ("array", "grad")}
    images.copy_(expected["image"])
    return {**expected, "image": images}, expected


def test_a_tensor_built_in_a_slot_travels_without_a_copy_and_exactly(pair, monkeypatch):
    writer, reader = pair
    batch, expected = _built_in_slot(writer)
    copied = []
    real = slots._storage_bytes
    monkeypatch.setattr(slots, "_storage_bytes", lambda s: (copied.append(s.data_ptr()), real(s))[1])
    packed = writer.pack(batch)
    assert packed.layout[0] == (0, 0, (4, 6, 5, 3), (90, 15, 3, 1), torch.uint8)  # span 0 ...
    assert packed.spans[0] == (0, 4 * 6 * 5 * 3)  # ... where it was built: offset 0
    built_on = batch["image"].untyped_storage().data_ptr()
    assert built_on not in copied and copied  # the other tensors were copied in after it
    monkeypatch.undo()
    assert_identical(reader.unpack(0, packed, wanted=True), expected)
    reader.give_back_freed()
    # The batch was dropped, its slot came back: the next allocation reuses it.
    batch, expected = _built_in_slot(writer)
    packed = writer.pack(batch)
    assert packed.slot == 0 and not packed.new_slots
    assert_identical(reader.unpack(0, packed, wanted=True), expected)


def test_an_allocation_the_batch_does_not_use_is_given_back(pair):
    writer, reader = pair
    writer.allocate((1000,), torch.float32)  # the producer failed, or took another path
    other = {"x": torch.arange(10)}
    packed = writer.pack(other)
    # The reserved slot's storage still reaches the reader (slot 0), and the batch may use it.
    assert 0 in packed.new_slots
    assert_identical(reader.unpack(0, packed, wanted=True), other)
    writer.allocate((10,), torch.int64)
    writer.allocate((10,), torch.int64)  # a second allocation gives the first back first
    packed = writer.pack(["no tensors"])
    assert reader.unpack(0, packed, wanted=True) == ["no tensors"]
    assert torch.equal(reader.unpack(0, writer.pack(other), wanted=True)["x"], other["x"])


def test_a_slot_too_small_for_the_rest_of_the_batch_falls_back_to_copying(pair):
    writer, reader = pair
    images = writer.allocate((16,), torch.uint8)
    images.copy_(torch.arange(16, dtype=torch.uint8))
    big = torch.arange(1 << 19, dtype=torch.int64)  # 4 MiB: more than the slot has left
    packed = writer.pack({"image": images, "big": big})
    out = reader.unpack(0, packed, wanted=True)
    assert torch.equal(out["image"], torch.arange(16, dtype=torch.uint8)) and torch.equal(out["big"], big)


def _storage_numbers(tensors):
    """For each tensor, which of the given tensors' storages it is on (numbered in order)."""
    seen: dict[int, int] = {}
    return [seen.setdefault(t.untyped_storage().data_ptr(), len(seen)) for t in tensors]


def test_views_of_one_storage_come_back_as_views_of_one_storage(pair):
    """Strides, relative offsets and shared storages survive; one span carries the storage."""
    writer, reader = pair
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    batch = [base, base[1], base.t(), base[:, ::2], base.view(torch.uint8), base[2:, 3:].expand(2, 2, 3),
             torch.arange(5)]
    packed = writer.pack(batch)
    assert len(packed.spans) == 2  # base's storage once, and arange(5)'s
    out = reader.unpack(0, packed, wanted=True)
    assert_identical(out, batch)
    assert [t.stride() for t in out] == [t.stride() for t in batch]
    assert [t.storage_offset() for t in out] == [t.storage_offset() for t in batch]
    assert _storage_numbers(out) == _storage_numbers(batch) == [0, 0, 0, 0, 0, 0, 1]
    out[0][1, 0] = -1.0  # a view of one storage, as in the worker
    assert out[1][0] == -1.0 and out[2][0, 1] == -1.0


def test_far_apart_views_of_a_large_storage_travel_compact(pair):
    """Rows picked from a large tensor (a dataset's, say) do not send the storage between them:
    rows far apart go on their own, rows close together share one span, one column is made
    contiguous; the values are exact."""
    writer, reader = pair
    table = torch.arange(4096 * 64, dtype=torch.int64).view(4096, 64)  # 2 MiB
    batch = {"far": table[4000], "column": table[:, 5], "near": [table[10], table[11], table[3]]}
    packed = writer.pack(batch)
    assert sum(nbytes for _, nbytes in packed.spans) < 64 << 10
    out = reader.unpack(0, packed, wanted=True)
    assert_identical(out, batch)
    assert out["column"].is_contiguous()
    assert _storage_numbers([*out["near"], out["far"], out["column"]]) == [0, 0, 0, 1, 2]


Pair = __import__("collections").namedtuple("Pair", "left right")


def test_namedtuples_ordered_and_default_dicts_are_walked_and_keep_their_types(pair):
    import collections

    writer, reader = pair
    counts = collections.defaultdict(list, {"x": [torch.ones(3)]})
    batch = {"pair": Pair(torch.arange(3), [Pair(torch.zeros(2), "s")]),
             "ordered": collections.OrderedDict(b=torch.ones(1), a=torch.tensor(True)),
             "counts": counts, "deep": [[[(torch.tensor([1 + 2j]),)]]]}
    packed = writer.pack(batch)
    assert len(packed.layout) == 6  # every tensor went through the slot, none was pickled
    out = reader.unpack(0, packed, wanted=True)
    assert_identical(out, batch)
    assert type(out["pair"]) is Pair and type(out["pair"].right[0]) is Pair
    assert out["counts"].default_factory is list


def test_what_the_slots_cannot_take_apart_travels_whole(pair):
    """A structure that holds itself cannot be walked: it travels pickled as it is. Tensors the
    slots do not carry (nested, needing grad, a subclass) stay in the structure."""
    writer, reader = pair
    loop: list = [torch.ones(2)]
    loop.append(loop)
    packed = writer.pack(loop)
    assert packed.slot is None and packed.structure is loop
    odd = {"nested": torch.nested.nested_tensor([torch.ones(1), torch.ones(2)]),
           "grad": torch.ones(2, requires_grad=True), "plain": torch.arange(3),
           "parameter": torch.nn.Parameter(torch.ones(2))}
    packed = writer.pack(odd)
    assert len(packed.layout) == 1  # only "plain"
    for name in ("nested", "grad", "parameter"):
        assert packed.structure[name] is odd[name]
    assert torch.equal(reader.unpack(0, packed, wanted=True)["plain"], torch.arange(3))


def test_a_batch_of_zero_size_tensors_needs_no_slot(pair):
    writer, reader = pair
    batch = (torch.zeros(0, 3), torch.zeros(3, 0).t(), torch.zeros(0, dtype=torch.bool))
    packed = writer.pack(batch)
    assert packed.slot is None and len(packed.layout) == 3
    out = reader.unpack(0, packed, wanted=True)
    assert_identical(out, batch)
    assert [t.stride() for t in out] == [t.stride() for t in batch]


def test_a_batch_that_was_not_sent_gives_its_slot_back(pair):
    """`unsent`: the batch's slot is free again, and the slot made for it reaches the reader with
    the next batch (which reuses it)."""
    writer, reader = pair
    lost = writer.pack({"x": torch.ones(4)})
    assert lost.new_slots
    writer.unsent(lost)
    packed = writer.pack({"x": torch.full((4,), 2.0)})
    assert packed.slot == lost.slot and set(lost.new_slots) <= set(packed.new_slots)
    assert torch.equal(reader.unpack(0, packed, wanted=True)["x"], torch.full((4,), 2.0))


def test_a_batch_collated_into_allocated_tensors_travels_without_a_copy(pair, monkeypatch):
    """`allocate_many`: the tensors a batch is collated into lie in one slot, each on a storage
    of its own; `pack` copies none of them (only what was made elsewhere), and each comes back
    on a storage of exactly its bytes, as collate's private tensors would."""
    writer, reader = pair
    images, means = writer.allocate_many([((4, 3, 5, 6), torch.uint8), ((4, 3), torch.float32)])
    images.copy_(torch.arange(4 * 3 * 5 * 6).view(4, 3, 5, 6).to(torch.uint8))
    means.copy_(torch.linspace(0, 1, 12).view(4, 3))
    assert images.untyped_storage().data_ptr() != means.untyped_storage().data_ptr()
    batch = {"img": images, "mean": means, "label": torch.arange(4), "names": ["a", "b", "c", "d"]}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    copied = []
    real = slots._storage_bytes
    monkeypatch.setattr(slots, "_storage_bytes", lambda s: (copied.append(s.data_ptr()), real(s))[1])
    packed = writer.pack(batch)
    monkeypatch.undo()
    assert copied == [batch["label"].untyped_storage().data_ptr()]  # only the label was copied
    assert packed.spans[0] == (0, 4 * 3 * 5 * 6) and packed.spans[1][0] % 64 == 0
    out = reader.unpack(0, packed, wanted=True)
    assert_identical(out, expected)
    assert out["img"].untyped_storage().nbytes() == 4 * 3 * 5 * 6
    assert out["mean"].untyped_storage().nbytes() == 4 * 3 * 4
    del out
    reader.give_back_freed()
    # The slot came back: the next batch is collated into it again, and a batch that did not
    # use its allocation (it fell back to collate's own tensors) gives it back.
    again = writer.allocate_many([((4, 3, 5, 6), torch.uint8)])[0]
    assert again.untyped_storage().data_ptr() == images.untyped_storage().data_ptr()
    unused = {"img": torch.ones(4, 3, 5, 6, dtype=torch.uint8)}
    packed = writer.pack(unused)
    assert_identical(reader.unpack(0, packed, wanted=True), unused)


def test_tensors_allocated_together_that_outgrow_the_slot_are_copied_into_a_larger_one(pair):
    writer, reader = pair
    small = writer.allocate_many([((16,), torch.uint8), ((2,), torch.int64)])
    small[0].copy_(torch.arange(16, dtype=torch.uint8))
    small[1].copy_(torch.tensor([5, 6]))
    big = torch.arange(1 << 19, dtype=torch.int64)  # 4 MiB: more than the slot has left
    batch = {"a": small[0], "b": small[1], "big": big}
    expected = {k: v.clone() for k, v in batch.items()}
    assert_identical(reader.unpack(0, writer.pack(batch), wanted=True), expected)
