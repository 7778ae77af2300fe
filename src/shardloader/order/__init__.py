"""Pure functions of (sizes, seed, epoch, settings): sample order, rank split, sample keys, and the
built-in pure samplers (`WeightedSampler`, `GroupedBatchSampler`)."""

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
