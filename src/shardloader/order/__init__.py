"""Pure functions of (sizes, seed, epoch, settings): sample order, rank split, sample keys, and the
built-in pure samplers (`WeightedSampler`, `GroupedBatchSampler`).

The names below are imported on first use (PEP 562): `seeding` imports torch, and the modules
that need only keys or permutations (the writers, whose engine tasks each start a fresh
interpreter) import `shardloader.order.keys` / `.permute` without paying for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardloader.order.grouped import GroupedBatchSampler
    from shardloader.order.partition import (
        TAILS,
        dropped_samples,
        epoch_length,
        padded_samples,
        step_counts,
        step_positions,
        steps_per_epoch,
    )
    from shardloader.order.seeding import GlobalRngScope, sample_generator, sample_key
    from shardloader.order.shuffle import ORDER_VERSION, EpochOrder, ShuffleSettings
    from shardloader.order.weighted import WeightedSampler

_EXPORTS = {
    **dict.fromkeys(("TAILS", "dropped_samples", "epoch_length", "padded_samples", "step_counts",
                     "step_positions", "steps_per_epoch"), "shardloader.order.partition"),
    **dict.fromkeys(("GlobalRngScope", "sample_generator", "sample_key"), "shardloader.order.seeding"),
    **dict.fromkeys(("ORDER_VERSION", "EpochOrder", "ShuffleSettings"), "shardloader.order.shuffle"),
    "GroupedBatchSampler": "shardloader.order.grouped",
    "WeightedSampler": "shardloader.order.weighted",
}

__all__ = [
    "ORDER_VERSION",
    "TAILS",
    "EpochOrder",
    "GlobalRngScope",
    "GroupedBatchSampler",
    "ShuffleSettings",
    "WeightedSampler",
    "dropped_samples",
    "epoch_length",
    "padded_samples",
    "sample_generator",
    "sample_key",
    "step_counts",
    "step_positions",
    "steps_per_epoch",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardloader.order' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
