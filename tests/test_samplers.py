"""Issue 38: the built-in pure samplers (`WeightedSampler`, `GroupedBatchSampler`), the Loader
with DataLoader's sampler arguments (same batches as DataLoader with the same sampler; the
refusals), the three resume paths in this process, the PureSampler protocol's hooks, and the
state's new keys."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from shardloader import GroupedBatchSampler, Loader, WeightedSampler
from shardloader.errors import StateError
from tests.resume import assert_exact_resume, assert_identical, plain_state, take
from tests.sampler_cases import EpochShuffle, IteratorState, N, Noisy, Resumable, make_loader

# -- WeightedSampler ------------------------------------------------------------------------------

WEIGHTS = np.array([0.0, 1.0, 2.0, 0.0, 5.0, 2.0])


def test_weighted_with_replacement_follows_the_weights():
    sampler = WeightedSampler(WEIGHTS, 60_000)
    drawn = sampler.samples_at(3, 1, np.arange(60_000))
    share = np.bincount(drawn, minlength=WEIGHTS.size) / drawn.size
    assert np.abs(share - WEIGHTS / WEIGHTS.sum()).max() < 0.01, share
    assert share[0] == share[3] == 0  # weight 0: never


def test_weighted_is_a_pure_function_of_seed_epoch_and_position():
    sampler = WeightedSampler(WEIGHTS, 500)
    every = sampler.samples_at(3, 1, np.arange(500))
    some = np.array([499, 7, 0, 250])
    assert np.array_equal(sampler.samples_at(3, 1, some), every[some])
    assert np.array_equal(WeightedSampler(WEIGHTS, 500).samples_at(3, 1, np.arange(500)), every)
    assert not np.array_equal(sampler.samples_at(3, 2, np.arange(500)), every)  # another epoch
    assert not np.array_equal(sampler.samples_at(4, 1, np.arange(500)), every)  # another seed


def test_weighted_without_replacement_draws_each_sample_once_in_a_weighted_order():
    weights = np.array([1.0, 0.0, 100.0, 1.0, 1.0])
    sampler = WeightedSampler(weights, 4, replacement=False)
    firsts = []
    for epoch in range(300):
        epoch_samples = sampler.samples_at(0, epoch, np.arange(4))
        assert sorted(epoch_samples.tolist()) == [0, 2, 3, 4]  # weight 0 left out, none twice
        firsts.append(int(epoch_samples[0]))
    assert firsts.count(2) > 250  # the heavy one comes first almost always (100/103)
    clone = WeightedSampler(weights, 4, replacement=False)
    assert np.array_equal(clone.samples_at(0, 9, np.array([3, 1])), sampler.samples_at(0, 9, np.arange(4))[[3, 1]])


@pytest.mark.parametrize("kwargs,message", [
    (dict(weights=[1.0, -1.0], num_samples=2), r"weights\[1\]"),
    (dict(weights=[1.0, float("nan")], num_samples=2), r"weights\[1\]"),
    (dict(weights=[0.0, 0.0], num_samples=2), "sum to 0"),
    (dict(weights=[1.0, 1.0], num_samples=0), "num_samples"),
    (dict(weights=[1.0, 0.0], num_samples=2, replacement=False), "num_samples=2 without replacement"),
])
def test_weighted_refuses_bad_arguments_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightedSampler(**kwargs)


# -- GroupedBatchSampler --------------------------------------------------------------------------

GROUPS = np.array([i % 4 for i in range(23)])


@pytest.mark.parametrize("drop_last", [False, True])
def test_grouped_batches_hold_one_group_and_each_sample_once(drop_last):
    sampler = GroupedBatchSampler(GROUPS, 4, drop_last=drop_last)
    batches = sampler.batches_at(1, 0, np.arange(len(sampler)))
    assert len(batches) == len(sampler) == (4 * 1 if drop_last else 4 * 2)
    for batch in batches:
        assert len(set(GROUPS[batch].tolist())) == 1
        assert len(batch) == 4 or not drop_last
    seen = np.concatenate(batches)
    assert len(set(seen.tolist())) == seen.size
    if not drop_last:
        assert sorted(seen.tolist()) == list(range(23))
    again = sampler.batches_at(1, 1, np.arange(len(sampler)))
    assert [b.tolist() for b in again] != [b.tolist() for b in batches]  # shuffled per epoch
    picked = sampler.batches_at(1, 0, [3, 0])
    assert [b.tolist() for b in picked] == [batches[3].tolist(), batches[0].tolist()]


def test_grouped_refuses_what_gives_no_batch():
    with pytest.raises(ValueError, match="batch_size=10"):
        GroupedBatchSampler([0, 0, 1], 10, drop_last=True)
    with pytest.raises(ValueError, match="batch_size"):
        GroupedBatchSampler([0, 0, 1], 0)


# -- the Loader with them: DataLoader's batches, resume -------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
def test_pure_samplers_give_what_dataloader_gives_with_them(num_workers):
    """A built-in sampler iterated by DataLoader (its own seed and epoch) gives the batches a
    Loader with the same seed and epoch reads, bit for bit (the dataset draws no random
    numbers, so the bytes are the dataset's under both)."""
    dataset = Plain()
    weighted = WeightedSampler(np.arange(N) % 3, 30, seed=4)
    weighted.set_epoch(1)
    expected = list(DataLoader(dataset, batch_size=4, sampler=weighted))
    with Loader(dataset, batch_size=4, sampler=weighted, seed=4, num_workers=num_workers) as loader:
        loader.set_epoch(1)
        assert_identical(list(loader), expected, "weighted")
    grouped = GroupedBatchSampler(np.arange(N) % 3, 4, seed=4)
    expected = list(DataLoader(dataset, batch_sampler=grouped))
    with Loader(dataset, batch_sampler=grouped, seed=4, num_workers=num_workers) as loader:
        assert_identical(list(loader), expected, "grouped")


class Plain(torch.utils.data.Dataset):
    """Draws no random numbers: DataLoader and the Loader give the same bytes."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((2,), float(i)), "i": i}


@pytest.mark.parametrize("case", ["weighted", "weighted-no-replacement", "grouped", "grouped-short",
                                  "stateful", "stateful-batches", "iterator-state", "fast-forward",
                                  "dataset-state"])
def test_resume_in_this_process_is_exact(case):
    """Cuts inside epochs and at an epoch's end, states through JSON (tests/resume.py)."""
    make = lambda: make_loader(case, num_workers=0)  # noqa: E731
    steps = len(make())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fast-forward's warning: tested below
        assert_exact_resume(make, 2 * steps + 1, [[1], [steps - 1, steps], [steps, steps + 2]])


def test_fast_forward_warns_naming_the_sampler_and_the_cost():
    loader = Loader(Noisy(), batch_size=3, sampler=EpochShuffle())
    take(loader, 4)
    state = plain_state(loader.state_dict())
    assert "sampler" not in state  # nothing to save: it is drawn again
    resumed = Loader(Noisy(), batch_size=3, sampler=EpochShuffle())
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"EpochShuffle.*fast-forward.*12 indices.*O\(position\)") as caught:
        next(iter(resumed))
    assert "state_dict()" in str(caught[0].message) and "PureSampler" in str(caught[0].message)


def test_a_stateful_sampler_resumes_from_its_state_without_a_warning():
    loader = Loader(Noisy(), batch_size=3, sampler=Resumable(), num_workers=2)
    take(loader, 4)
    state = plain_state(loader.state_dict())
    loader.close()
    assert state["sampler"] == {"rounds": 1, "yielded": 12}  # the 4th batch's, not the prefetched
    resumed = Loader(Noisy(), batch_size=3, sampler=Resumable())
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(resumed))


def test_a_sampler_whose_iterator_has_the_state_resumes_from_it_without_a_warning():
    """torchdata's convention: iter(sampler) has state_dict()/load_state_dict(). The state of
    the 4th batch's indices is saved (not the prefetched ones'); the resume loads it into a new
    iter(sampler) and continues exactly, with no fast-forward."""
    with Loader(Noisy(), batch_size=3, sampler=IteratorState(), num_workers=2) as loader:
        rest = list(loader)[4:]
    state_loader = Loader(Noisy(), batch_size=3, sampler=IteratorState(), num_workers=2)
    take(state_loader, 4)
    state = plain_state(state_loader.state_dict())
    state_loader.close()
    assert state["sampler"] == {"round": 1, "yielded": 12}
    resumed = Loader(Noisy(), batch_size=3, sampler=IteratorState())
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = list(resumed)
    assert_identical(got, rest, "the rest of the epoch from the iterator's state")


def test_a_distributed_sampler_is_this_ranks_and_must_agree_with_the_loader():
    dataset = Plain()
    mine = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    expected = list(DataLoader(dataset, batch_size=3, sampler=mine))
    with Loader(dataset, batch_size=3, sampler=mine, rank=1, world_size=2) as loader:
        assert_identical(list(loader), expected, "rank 1's DistributedSampler, not split again")
    with pytest.raises(ValueError, match=r"num_replicas=2, rank=1.*write DistributedSampler\(dataset, "
                                         r"num_replicas=4, rank=1\)"):
        Loader(dataset, batch_size=3, sampler=mine, rank=1, world_size=4)


class Hooked:
    """A PureSampler with the optional hooks: its order is reversed after `load_order_state`
    is given {"reversed": True}."""

    fingerprint = "Hooked v1"

    def __init__(self) -> None:
        self.reversed = False
        self.loaded: Any = None

    def __len__(self) -> int:
        return N

    def samples_at(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        return (N - 1 - positions) if self.reversed else positions

    def order_state(self, epoch: int, position: int) -> dict[str, Any]:
        return {"reversed": True, "at": [epoch, position]}

    def load_order_state(self, state: dict[str, Any], epoch: int, position: int) -> None:
        self.loaded = (state, epoch, position)
        self.reversed = bool(state["reversed"])


def test_pure_sampler_hooks_and_fingerprint():
    loader = Loader(Plain(), batch_size=4, sampler=Hooked())
    assert [b["i"].tolist() for b in take_batches(loader, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    state = plain_state(loader.state_dict())
    assert state["sampler"] == {"reversed": True, "at": [0, 8]}
    assert state["fingerprint"]["sampler"] == "Hooked v1"
    hooked = Hooked()
    resumed = Loader(Plain(), batch_size=4, sampler=hooked)
    resumed.load_state_dict(state)
    assert hooked.loaded == ({"reversed": True, "at": [0, 8]}, 0, 8)
    assert next(iter(resumed))["i"].tolist() == [31, 30, 29, 28]  # positions 8..11, reversed
    other = Loader(Plain(), batch_size=4, sampler=WeightedSampler(np.ones(N), N))
    with pytest.raises(StateError, match="sampler: saved 'Hooked v1'"):
        other.load_state_dict(state)


def take_batches(loader: Loader, count: int) -> list[Any]:
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)]


class OwnOrder(Plain):
    """A dataset that carries its own order (`OrdersItself`)."""

    def epoch_sampler(self, shuffle: bool) -> Hooked:
        sampler = Hooked()
        sampler.reversed = shuffle
        return sampler


def test_a_dataset_that_orders_itself_gives_the_loaders_order():
    with Loader(OwnOrder(), batch_size=5, shuffle=True) as loader:
        assert next(iter(loader))["i"].tolist() == [39, 38, 37, 36, 35]
        assert loader.fingerprint()["sampler"] == "Hooked v1"


def test_state_keys_are_validated_and_old_states_still_load():
    loader = Loader(Plain(), batch_size=4, shuffle=True)
    take_batches(loader, 2)
    state = plain_state(loader.state_dict())
    assert "sampler" not in state and "dataset" not in state
    old = {**state, "fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "sampler"}}
    fresh = Loader(Plain(), batch_size=4, shuffle=True)
    fresh.load_state_dict(old)  # saved before issue 38: no sampler field, the own order
    for key in ("sampler", "dataset"):
        with pytest.raises(StateError, match=f"field '{key}' must be a dict"):
            fresh.load_state_dict({**state, key: [1]})


def test_dataset_state_is_the_last_delivered_batchs_workers():
    """Two worker processes take tasks in turn: after 3 batches of 3, the third batch's worker
    (worker 0: batches 1 and 3) has read 6 samples — not the 12 it read ahead."""
    loader = make_loader("dataset-state", num_workers=2)
    take(loader, 3)
    assert loader.state_dict()["dataset"] == {"seen": 6}
    loader.close()
    inline = make_loader("dataset-state", num_workers=0)
    take(inline, 3)
    assert inline.state_dict()["dataset"] == {"seen": 9}


def test_unbatched_resume_is_exact():
    make = lambda: Loader(Noisy(), batch_size=None, shuffle=True, num_workers=0)  # noqa: E731
    assert_exact_resume(make, N + 3, [[5], [N - 1, N]], reference=None)


def test_the_protocol_example_in_the_docs_runs_and_balances_classes():
    """docs/samplers.md's PureSampler example, as written (but the last line, which needs the
    reader's dataset), read by a Loader with workers."""
    import re
    from pathlib import Path

    from shardloader.loader.protocol import PureSampler

    text = (Path(__file__).resolve().parent.parent / "docs" / "samplers.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[1]
    namespace: dict[str, Any] = {}
    exec(code.rsplit("\nloader = ", 1)[0], namespace)  # noqa: S102 - the documented example
    labels = np.array([i % 3 for i in range(N)])
    labels[:20] = 0
    sampler = namespace["Balanced"](labels)
    assert isinstance(sampler, PureSampler)
    with Loader(Plain(), batch_size=4, sampler=sampler, num_workers=2) as loader:
        read = np.concatenate([batch["i"].numpy() for batch in loader])
    assert np.array_equal(read, sampler.samples_at(0, 0, np.arange(len(sampler))))
    assert np.bincount(labels[read]).tolist() == [sampler.per_class] * 3
