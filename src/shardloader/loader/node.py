"""`LoaderNode`: a Loader as a `torchdata.nodes` node, with that package's state contract.

torchdata.nodes composes pipeline stages (`BaseNode`: `reset(initial_state)`, `next()`,
`get_state()`) and checkpoints a whole pipeline through `torchdata.nodes.Loader.state_dict()`.
Wrapping a shardloader `Loader` as the source node lets such a pipeline add its own stages
(`Mapper` for a device copy or a batch-level transform, `PinMemory`, `Prefetcher`,
`MultiNodeWeightedSampler` to mix several loaders) and still resume exactly: the node's state
is the Loader's own O(1) cursor, so nothing is replayed, and torchdata's stages snapshot it
alongside theirs.

Each item is one batch of the Loader. Epochs follow torchdata's convention (like its
`SamplerWrapper`): `reset(None)` after batches were taken starts the next epoch;
`reset(state)` continues exactly where `state` was taken, and a state taken at an epoch's end
continues with the next epoch. With a `Prefetcher` in front, the Loader's `fetch_seconds`
measure the prefetch thread's wait, not the training thread's.

Worker processes are forked when an epoch starts, in the thread that resets the pipeline. As
with DataLoader, do not let that happen while another loader of the same process reads inline
(num_workers=0) in a background thread: the fork can copy a lock that thread holds into the
workers. Give such loaders worker processes too, or `multiprocessing_context="forkserver"`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchdata.nodes import BaseNode

from shardloader.loader.loader import Loader


class LoaderNode(BaseNode[Any]):
    """The batches of `loader` as a torchdata.nodes source node."""

    LOADER_KEY = "loader"

    def __init__(self, loader: Loader) -> None:
        super().__init__()
        if not isinstance(loader, Loader):
            raise TypeError(f"LoaderNode wraps a shardloader Loader, got {type(loader).__name__}")
        self.loader = loader
        self._it: Iterator[Any] | None = None
        self._started = False  # a batch of the current pass was taken
        self._ended = False  # the current pass ran to its end (the Loader's epoch advanced)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            if self.LOADER_KEY not in initial_state:
                raise ValueError(f"LoaderNode state must hold {self.LOADER_KEY!r}; got keys "
                                 f"{sorted(initial_state)}")
            self.loader.load_state_dict(initial_state[self.LOADER_KEY])
            if self.loader._cursor.epoch_finished:  # saved at an epoch's end: continue with the next
                self.loader.set_epoch(self.loader.epoch + 1)
        elif self._started and not self._ended:
            self.loader.set_epoch(self.loader.epoch + 1)  # a new pass is the next epoch
        self._started = self._ended = False
        self._it = iter(self.loader)

    def next(self) -> Any:
        assert self._it is not None  # BaseNode calls reset() before the first next()
        try:
            batch = next(self._it)
        except StopIteration:
            self._ended = True  # the Loader moved on to the next epoch itself
            raise
        self._started = True
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.LOADER_KEY: self.loader.state_dict()}
