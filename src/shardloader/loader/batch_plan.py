"""`BatchPlan`: the steps of a `PureBatchSampler` (see `shardloader.loader.protocol`): batch
`step` of an epoch is `batches_at(seed, epoch, [step])`, a pure function of (seed, epoch), so
resume is exact and O(1) under any num_workers and world size.

Each batch is a global batch: rank r of W reads its items r, r + W, ... (as the Loader splits
its own global batches, `shardloader.order.partition`). The cursor counts batches. The batch's
indices are computed in the training process (it needs each batch's size anyway) and travel in
the task; a batch sampler that materialises an epoch (`GroupedBatchSampler`) does so once per
epoch there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardloader.loader.plan import SamplerOrder


@dataclass
class BatchPlan:
    batch_sampler: Any
    seed: int
    rank: int
    world_size: int
    shard_offsets: np.ndarray = field(repr=False)

    looks_ahead = True

    @property
    def global_steps(self) -> int:
        return len(self.batch_sampler)

    @property
    def length(self) -> int:
        """Cursor positions per epoch: one per batch."""
        return len(self.batch_sampler)

    def rank_batches(self) -> int:
        return self.global_steps

    def begin(self, epoch: int, first_step: int) -> None:
        """Nothing to do: a pure order."""

    def samples(self, epoch: int, step: int, rank: int | None = None) -> np.ndarray:
        """This rank's (or `rank`'s) share of the global batch at `step` of `epoch`."""
        batch = self.batch_sampler.batches_at(self.seed, epoch, np.array([step], dtype=np.int64))[0]
        return np.asarray(batch, dtype=np.int64)[self.rank if rank is None else rank::self.world_size]

    def draw(self, epoch: int, step: int, *, inline: bool) -> tuple[np.ndarray, int, int]:
        samples = self.samples(epoch, step)
        return samples, 0, samples.size

    def order(self, epoch: int) -> SamplerOrder:
        """For `shards_of` (prefetch); `samples_at` has no meaning for a batch sampler."""
        return SamplerOrder(None, self.seed, epoch, self.shard_offsets)

    def tail_report(self) -> dict[str, int]:
        return {"padded": 0, "dropped": 0}
