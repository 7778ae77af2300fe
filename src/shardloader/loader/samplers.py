"""`loader.sampler` and `loader.batch_sampler`: the Loader's own order, shaped as the objects
DataLoader exposes, for code that reads them.

Trainers and scripts reach into a DataLoader's sampler: Lightning calls `set_epoch` on
`loader.sampler` and `loader.batch_sampler.sampler` at each epoch's start, scripts call
`loader.sampler.set_epoch(epoch)` where they used a DistributedSampler, and read
`len(loader.sampler)` to count samples. These objects answer from the Loader's plan (a pure
function of seed, epoch and settings: nothing is drawn) and forward `set_epoch` to the Loader,
so they drive its order instead of competing with it. They hold the Loader weakly: a Loader
dropped by its user is not kept alive (and its workers not kept running) by its sampler.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler


class _LoaderView:
    """Base: the Loader these objects describe, held weakly."""

    def __init__(self, loader: Any) -> None:
        self._loader_ref = weakref.ref(loader)

    @property
    def loader(self) -> Any:
        loader = self._loader_ref()
        if loader is None:
            raise ReferenceError("the Loader this sampler belongs to no longer exists")
        return loader

    def set_epoch(self, epoch: int) -> None:
        """The Loader's `set_epoch` (the same rules: see `Loader`)."""
        self.loader.set_epoch(epoch)


class LoaderSampler(_LoaderView, Sampler[int]):
    """The global indices of the Loader's current epoch, in order, for this rank.

    In one process: every sample of the epoch, as DataLoader's sampler lists them (with
    `drop_last=True` too: only the batch sampler leaves out the short last batch). Under a
    world size > 1: the samples of this rank's batches (as a DistributedSampler's share)."""

    def __iter__(self) -> Iterator[int]:
        loader = self.loader
        epoch = loader.epoch
        if loader.world_size == 1:
            yield from loader.epoch_order(epoch).samples_at(np.arange(loader.num_samples)).tolist()
            return
        for step in range(loader._plan.global_steps):
            yield from loader.step_samples(epoch, step).tolist()

    def __len__(self) -> int:
        loader = self.loader
        return loader.num_samples if loader.world_size == 1 else loader.samples_per_epoch


class LoaderBatchSampler(_LoaderView, Sampler[list[int]]):
    """This rank's batches of the Loader's current epoch, each a list of global indices."""

    def __init__(self, loader: Any, sampler: LoaderSampler) -> None:
        super().__init__(loader)
        self.sampler = sampler

    @property
    def batch_size(self) -> int:
        return int(self.loader.batch_size)

    @property
    def drop_last(self) -> bool:
        return bool(self.loader.drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        loader = self.loader
        epoch = loader.epoch
        for step in range(loader._plan.global_steps):
            samples = loader.step_samples(epoch, step)
            if len(samples):  # tail="partial": a rank may get nothing of the last global batch
                yield samples.tolist()

    def __len__(self) -> int:
        return len(self.loader)
