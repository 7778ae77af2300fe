"""shardloader: sharded, cached, prefetched and exactly resumable data loading for PyTorch.

The public names are imported on first use (PEP 562), so `import shardloader` and the
`shardloader` command line stay fast: only `Loader` pulls in torch, and only when used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardloader._version import __version__
from shardloader.runtime.startup import paused_gc

if TYPE_CHECKING:
    from shardloader.dataset.sharded import Dataset
    from shardloader.ingest.writer import write_shards
    from shardloader.loader import Loader
    from shardloader.loader.mixture import Mixture, MixtureSource
    from shardloader.loader.node import LoaderNode
    from shardloader.order.grouped import GroupedBatchSampler
    from shardloader.order.weighted import WeightedSampler

_EXPORTS = {
    "Dataset": "shardloader.dataset.sharded",
    "GroupedBatchSampler": "shardloader.order.grouped",
    "WeightedSampler": "shardloader.order.weighted",
    "Loader": "shardloader.loader",
    "LoaderNode": "shardloader.loader.node",
    "Mixture": "shardloader.loader.mixture",
    "MixtureSource": "shardloader.loader.mixture",
    "write_shards": "shardloader.ingest.writer",
}

__all__ = ["Dataset", "GroupedBatchSampler", "Loader", "LoaderNode", "Mixture", "MixtureSource", "WeightedSampler",
           "__version__", "write_shards"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardloader' has no attribute {name!r}")
    with paused_gc():  # no full collection of the user's heap inside our imports (see startup.py)
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
