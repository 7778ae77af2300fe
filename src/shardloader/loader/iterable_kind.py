"""Which datasets a `Loader` reads as iterable datasets, and the class that reads them.

DataLoader reads a dataset one of two ways: map-style (`len(dataset)` and `dataset[i]`, in the
order of its sampler) or iterable (each worker iterates its own copy of the dataset, and the
dataset's iteration is the order). An iterable dataset is a `torch.utils.data.IterableDataset`
(a Hugging Face `datasets.IterableDataset` is one, once torch is imported) or any other object
with `__iter__` and no `__getitem__` that is not a `shardloader.Dataset`.

`Loader(dataset, ...)` makes an instance of the class registered here for iterable datasets
(`shardloader.loader.iterable.IterableLoader`, a subclass of `Loader`, registers itself when
`shardloader.loader` is imported): see `Loader.__new__`. The registry keeps `loader.py` from
importing its own subclass (the imports point one way only: docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.utils.data import IterableDataset

from shardloader.loader.mapstyle import _Indexable
from shardloader.loader.protocol import is_sharded_dataset

#: The Loader subclass for iterable datasets (one entry once registered).
_ITERABLE_LOADER: list[type] = []


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether DataLoader would read `dataset` as an iterable dataset (see the module doc)."""
    if isinstance(dataset, IterableDataset):
        return True
    return (isinstance(dataset, Iterable) and not isinstance(dataset, _Indexable)
            and not is_sharded_dataset(dataset))


def register_iterable_loader(cls: type) -> type:
    """Make `cls` the class `Loader(iterable_dataset, ...)` instantiates."""
    _ITERABLE_LOADER[:] = [cls]
    return cls


def loader_class(cls: type, dataset: Any) -> type:
    """The class `Loader(dataset, ...)` makes: the registered Loader for an iterable dataset,
    else `cls` (the Loader)."""
    return _ITERABLE_LOADER[0] if _ITERABLE_LOADER and is_iterable_dataset(dataset) else cls
