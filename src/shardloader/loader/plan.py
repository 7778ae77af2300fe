"""`StepPlan`: which samples a rank reads at a step — the order module bound to one loader's
settings, small enough to send to worker processes.

Workers compute their own batch's samples from (epoch, step), so the training thread pays
nothing for the order (about a millisecond per batch of Feistel rounds otherwise).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from shardloader.order.partition import step_positions
from shardloader.order.shuffle import EpochOrder, ShuffleSettings


@dataclass
class StepPlan:
    shard_sizes: np.ndarray
    seed: int
    settings: ShuffleSettings
    rank: int
    world_size: int
    global_batch_size: int
    tail: str
    _cache: dict[int, EpochOrder] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # thread workers

    @property
    def num_samples(self) -> int:
        return int(self.shard_sizes.sum())

    def order(self, epoch: int) -> EpochOrder:
        """The epoch's order; the last two epochs are kept (an epoch boundary needs both)."""
        with self._lock:
            order = self._cache.get(epoch)
            if order is None:
                order = EpochOrder(self.shard_sizes, self.seed, epoch, self.settings)
                self._cache[epoch] = order
                while len(self._cache) > 2:
                    self._cache.pop(next(iter(self._cache)))
            return order

    def positions(self, step: int, rank: int | None = None) -> np.ndarray:
        return step_positions(step, self.rank if rank is None else rank, self.world_size,
                              self.global_batch_size, self.num_samples, self.tail)

    def samples(self, epoch: int, step: int, rank: int | None = None) -> np.ndarray:
        return self.order(epoch).samples_at(self.positions(step, rank))

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_cache"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
