"""Loaders over samplers for the issue-38 resume tests (tests/test_sampler_resume.py and its
child, tests/sampler_train.py): one function per case, importable by worker processes.

Every dataset here draws from torch's global RNG inside `__getitem__`, so a sample's bytes
depend on its augmentation key (seed, epoch, index): an order or key mix-up changes bytes,
not only indices.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, Dataset, Sampler

from shardloader import GroupedBatchSampler, Loader, WeightedSampler

N = 40


class Noisy(Dataset):
    """Sample i: {"x": 3 floats drawn from torch's global RNG (keyed per sample by the Loader),
    "i": i}."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.rand(3) + i, "i": i}


class Curriculum(Noisy):
    """A dataset with a state (StatefulDataLoader's convention): `seen` counts the samples this
    copy has read; its stage (seen // 7) is part of every sample, so a lost or wrong state
    changes the bytes."""

    def __init__(self) -> None:
        self.seen = 0

    def __getitem__(self, i: int) -> dict[str, Any]:
        stage = self.seen // 7
        self.seen += 1
        return {"x": torch.rand(3) + i, "i": i, "stage": stage}

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])


class EpochShuffle(Sampler[int]):
    """A plain sampler (no state_dict): a permutation from set_epoch's epoch, like
    DistributedSampler's; resumed by fast-forward."""

    def __init__(self, n: int = N) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.default_rng(100 + self.epoch).permutation(self.n).tolist())


class Resumable(Sampler[int]):
    """A stateful sampler (StatefulDataLoader's convention): its order depends on its history
    (each iteration draws a new permutation from a generator that lives across epochs, so a
    fast-forward could not find it again); `state_dict()` says where it is, and after
    `load_state_dict` the next `iter()` continues there (a finished iteration: a new one)."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.rounds = 0  # permutations drawn so far
        self.yielded = 0  # indices of the current permutation handed out

    def __len__(self) -> int:
        return self.n

    def _permutation(self) -> list[int]:
        return np.random.default_rng(7 + self.rounds).permutation(self.n).tolist()

    def __iter__(self) -> Iterator[int]:
        if self.yielded in (0, self.n):  # a new permutation
            self.rounds += 1
            self.yielded = 0
        permutation = self._permutation()
        while self.yielded < self.n:
            self.yielded += 1
            yield permutation[self.yielded - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds, self.yielded = int(state["rounds"]), int(state["yielded"])


class IteratorState(Sampler[int]):
    """torchdata's convention: the state is on the ITERATOR. Each `iter()` draws the next
    permutation (a counter on the sampler: the order depends on history, so a fast-forward
    could not find it again); the iterator's `state_dict()` says which permutation and how far,
    and its `load_state_dict` puts it (and the sampler's counter) there."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.rounds = 0  # permutations drawn so far

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> _PermutationIterator:
        self.rounds += 1
        return _PermutationIterator(self, self.rounds)


class _PermutationIterator:
    """`IteratorState`'s iterator: permutation `round`, `yielded` indices handed out."""

    def __init__(self, sampler: IteratorState, round: int) -> None:
        self.sampler, self.round, self.yielded = sampler, round, 0

    def __iter__(self) -> _PermutationIterator:
        return self

    def __next__(self) -> int:
        if self.yielded >= self.sampler.n:
            raise StopIteration
        self.yielded += 1
        return int(np.random.default_rng(50 + self.round).permutation(self.sampler.n)[self.yielded - 1])

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round, self.yielded = int(state["round"]), int(state["yielded"])
        self.sampler.rounds = self.round


class ResumableBatches(Sampler[list[int]]):
    """A stateful batch sampler: `Resumable`'s indices in batches of 3, 1, 3, 1, ..."""

    def __init__(self) -> None:
        self.inner = Resumable()
        self.sizes = [3, 1] * (N // 4)
        self.batches = 0  # batches of the current iteration handed out

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[list[int]]:
        if self.batches == len(self.sizes):
            self.batches = 0
        indices = iter(self.inner)
        while self.batches < len(self.sizes):
            size = self.sizes[self.batches]
            self.batches += 1
            yield [next(indices) for _ in range(size)]

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.batches = int(state["batches"])


#: Whether a case's batches are the same under world size 2 (both ranks) and 1: the Loader
#: splits a pure order's global batches across ranks; a user's sampler is per rank.
WORLD_CHANGE = {"weighted", "weighted-no-replacement", "grouped", "own"}


def make_loader(case: str, *, num_workers: int, rank: int = 0, world_size: int = 1,
                global_batch: int = 8) -> Loader:
    """The case's Loader for `rank` of `world_size` (a global batch of `global_batch`)."""
    common: dict[str, Any] = dict(num_workers=num_workers, rank=rank, world_size=world_size, seed=5,
                                  persistent_workers=num_workers > 0)
    batch = global_batch // world_size
    if case == "own":
        return Loader(Noisy(), batch_size=batch, shuffle=True, tail="drop", **common)
    if case == "weighted":
        weights = np.arange(N, dtype=np.float64) % 5
        return Loader(Noisy(), batch_size=batch, sampler=WeightedSampler(weights, 48), tail="drop", **common)
    if case == "weighted-no-replacement":
        weights = 1.0 + np.arange(N, dtype=np.float64)
        return Loader(Noisy(), batch_size=batch, sampler=WeightedSampler(weights, 32, replacement=False),
                      tail="drop", **common)
    if case == "grouped":
        groups = [("tall", "wide", "square")[i % 3] for i in range(N)]
        return Loader(Noisy(), batch_sampler=GroupedBatchSampler(groups, 4, drop_last=True), **common)
    if case == "grouped-short":
        return Loader(Noisy(), batch_sampler=GroupedBatchSampler(np.arange(N) % 3, 5), **common)
    if case == "stateful":
        return Loader(Noisy(), batch_size=3, sampler=Resumable(), **common)
    if case == "iterator-state":
        return Loader(Noisy(), batch_size=3, sampler=IteratorState(), **common)
    if case == "stateful-batches":
        return Loader(Noisy(), batch_sampler=ResumableBatches(), **common)
    if case == "fast-forward":
        return Loader(Noisy(), batch_size=3, sampler=EpochShuffle(), **common)
    if case == "fast-forward-batches":
        return Loader(Noisy(), batch_sampler=BatchSampler(EpochShuffle(), 3, False), **common)
    if case == "dataset-state":
        return Loader(Curriculum(), batch_size=3, shuffle=True, **common)
    raise ValueError(f"unknown case {case!r}")
