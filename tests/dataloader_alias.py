"""One constructor for both loaders the conformance suite compares.

`make("dataloader", ds, **kwargs)` is `torch.utils.data.DataLoader(ds, **kwargs)`;
`make("loader", ds, **kwargs)` is `shardloader.Loader(ds, **kwargs)`. Nothing is mapped: every
keyword goes to both unchanged, because the point of the suite is that a user can swap one
class for the other without touching the arguments. (The only thing the tests avoid is
DataLoader's positional arguments after `batch_size`, which the Loader takes as keywords: they
pass everything by keyword, as a migrating user should.)
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

KINDS = ("dataloader", "loader")


def loader_class(kind: str) -> type:
    """The class `make(kind, ...)` instantiates."""
    if kind == "dataloader":
        return DataLoader
    if kind == "loader":
        import shardloader

        return shardloader.Loader
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def make(kind: str, dataset: Any, **kwargs: Any) -> Any:
    """`DataLoader(dataset, **kwargs)` or `shardloader.Loader(dataset, **kwargs)`, unchanged."""
    return loader_class(kind)(dataset, **kwargs)
