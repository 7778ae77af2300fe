"""Pure functions of (sizes, seed, epoch, settings): sample order, rank split, sample keys."""

from shardloader.order.partition import (
    TAILS,
    dropped_samples,
    epoch_length,
    padded_samples,
    step_positions,
    steps_per_epoch,
)
from shardloader.order.seeding import GlobalRngScope, sample_generator, sample_key
from shardloader.order.shuffle import EpochOrder, ShuffleSettings, resident_shards_per_rank

__all__ = [
    "TAILS",
    "EpochOrder",
    "GlobalRngScope",
    "ShuffleSettings",
    "dropped_samples",
    "epoch_length",
    "padded_samples",
    "resident_shards_per_rank",
    "sample_generator",
    "sample_key",
    "step_positions",
    "steps_per_epoch",
]
