"""`pin_memory=True`: what is pinned, where, and the batches it gives (shardloader.loader.pinning).

No accelerator here, so `Tensor.pin_memory()` cannot run: the tests replace the pinning call
itself (`pinning.pin_tensor`) by one that records the thread it runs on and returns a copy, and
say an accelerator is present. Everything else is real: the Loader, its worker processes, the
pinning thread and its queue.
"""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from shardloader import Loader
from shardloader.loader import pinning
from tests.resume import assert_identical

Pair = collections.namedtuple("Pair", ["image", "label"])


class Batch(dict):
    """A dict subclass with an attribute of its own (DataLoader keeps both through pinning)."""

    source = "default"


class SelfPinning:
    """A custom batch type that pins itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.pinned = False

    def pin_memory(self) -> SelfPinning:
        out = SelfPinning(self.tensor.clone())
        out.pinned = True
        return out


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Pair:
        if i == 13 and getattr(self, "fail", False):
            raise KeyError(f"no sample {i}")
        return Pair(torch.full((2, 2), float(i * i)), i)


@pytest.fixture
def recorded_pins(monkeypatch):
    """Pretend an accelerator is present; record the thread of every pinned tensor."""
    threads: list[str] = []

    def pin(tensor: torch.Tensor) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return tensor.clone()

    monkeypatch.setattr(pinning, "accelerator_available", lambda: True)
    monkeypatch.setattr(pinning, "pin_tensor", pin)
    return threads


def test_pin_batch_keeps_every_structure(recorded_pins):
    batch = Batch(image=torch.ones(2), names=["a", "b"], raw=b"x")
    batch.source = "mine"
    nested = {
        "batch": batch,
        "pair": Pair(torch.zeros(1), torch.ones(1)),
        "tuple": (torch.zeros(1), "s"),
        "ordered": collections.OrderedDict(a=torch.ones(1)),
        "custom": SelfPinning(torch.ones(3)),
        "number": 3,
    }
    out = pinning.pin_batch(nested)
    assert type(out["batch"]) is Batch and out["batch"].source == "mine"
    assert out["batch"]["names"] == ["a", "b"] and out["batch"]["raw"] == b"x"
    assert type(out["pair"]) is Pair and type(out["tuple"]) is tuple and out["tuple"][1] == "s"
    assert type(out["ordered"]) is collections.OrderedDict
    assert out["custom"].pinned and out["number"] == 3
    assert len(recorded_pins) == 5  # every tensor but the self-pinning object's
    assert_identical({k: v for k, v in out.items() if k != "custom"},
                     {k: v for k, v in nested.items() if k != "custom"})


def test_worker_batches_are_pinned_on_the_pinning_thread(recorded_pins):
    reference = list(Loader(Squares(), batch_size=5, num_workers=2))
    loader = Loader(Squares(), batch_size=5, num_workers=2, pin_memory=True)
    got = list(loader)
    assert len(got) == len(reference) == 5
    for a, b in zip(got, reference):
        assert_identical(a, b)
    assert recorded_pins and set(recorded_pins) == {"shardloader-pin-memory"}
    loader.close()
    assert not [t for t in threading.enumerate() if t.name == "shardloader-pin-memory"]


def test_without_workers_the_batch_is_pinned_where_it_is_made(recorded_pins):
    got = list(Loader(Squares(), batch_size=5, pin_memory=True))
    assert len(got) == 5 and set(recorded_pins) == {threading.current_thread().name}


def test_a_failing_sample_passes_the_pinning_thread_and_the_iterator_goes_on(recorded_pins):
    dataset = Squares()
    reference = list(Loader(dataset, batch_size=5, num_workers=2))
    dataset.fail = True
    loader = Loader(dataset, batch_size=5, num_workers=2, pin_memory=True)
    iterator = iter(loader)
    got = [next(iterator), next(iterator)]
    with pytest.raises(KeyError, match="no sample 13"):
        next(iterator)  # batch 2 holds samples 10..14
    got += list(iterator)
    for a, b in zip(got, reference[:2] + reference[3:], strict=True):
        assert_identical(a, b)
    loader.close()


def test_a_break_stops_the_pinning_thread(recorded_pins):
    loader = Loader(Squares(), batch_size=2, num_workers=2, pin_memory=True, persistent_workers=True)
    for _ in loader:
        break
    loader.close()
    assert not [t for t in threading.enumerate() if t.name == "shardloader-pin-memory"]


def test_without_an_accelerator_it_warns_and_pins_nothing():
    if pinning.accelerator_available():
        pytest.skip("an accelerator is present")
    with pytest.warns(UserWarning, match="no accelerator"):
        loader = Loader(Squares(), batch_size=5, pin_memory=True)
    for a, b in zip(loader, Loader(Squares(), batch_size=5), strict=True):
        assert_identical(a, b)
