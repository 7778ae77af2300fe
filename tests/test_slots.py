"""Worker-to-loader batch transport through reused shared-memory slots: byte-exact, any
structure, slots reused and grown, never blocking a worker."""

from __future__ import annotations

import multiprocessing

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
    real = slots._bytes_of
    monkeypatch.setattr(slots, "_bytes_of", lambda t: (copied.append(t.shape), real(t))[1])
    packed = writer.pack(batch)
    assert packed.layout[0] == (0, (4, 6, 5, 3), torch.uint8)  # where it was built: offset 0
    assert (4, 6, 5, 3) not in copied and copied  # the other tensors were copied in after it
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
