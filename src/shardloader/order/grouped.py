"""`GroupedBatchSampler`: batches whose samples share a group (an aspect-ratio bucket, a length
bucket), in an order shuffled per epoch — a pure batch sampler (`PureBatchSampler`, see
`shardloader.loader.protocol`), so a Loader resumes it exactly in O(1) under any num_workers
and world size.

An epoch, a pure function of (seed, epoch): each group's samples are permuted (keyed), cut
into batches of `batch_size` (the last one of a group short, or dropped with `drop_last`), and
the batches of all groups are shuffled together (keyed). Every batch is one group. The epoch's
batches are made once per epoch and process (O(N)) and kept for the last epoch asked for.

Under a Loader of world size W each batch is a global batch: rank r reads its samples r, r + W,
... (as the Loader splits its own global batches), so `batch_size` is the global batch size.
No torch here: numpy only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from shardloader.order.keys import TAG_GROUPED, derive_key
from shardloader.order.permute import keyed_permutation
from shardloader.order.weighted import check_count


class GroupedBatchSampler:
    """Batches of `batch_size` samples of one group each; `groups[i]` is sample i's group
    (any sortable values: ints, strings). `shuffle=False` keeps the samples and the batches in
    index order (groups in sorted order)."""

    def __init__(self, groups: Sequence[Any] | np.ndarray, batch_size: int, drop_last: bool = False,
                 *, shuffle: bool = True, seed: int = 0) -> None:
        keys = np.asarray(groups)
        if keys.ndim != 1 or keys.size == 0:
            raise ValueError(f"groups must be a non-empty 1-D sequence (one group per sample), got "
                             f"shape {keys.shape}")
        self.batch_size = check_count("batch_size", batch_size)
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last should be a boolean value, but got drop_last={drop_last!r}")
        self.drop_last = drop_last
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        _, group_of = np.unique(keys, return_inverse=True)
        order = np.argsort(group_of, kind="stable")  # samples grouped, index order inside
        sizes = np.bincount(group_of)
        #: Each group's samples (int64, index order), laid end to end; group g is
        #: members[starts[g]:starts[g + 1]].
        self.members = order.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        full, rest = np.divmod(sizes, self.batch_size)
        self._batches = int(full.sum() + (0 if drop_last else np.count_nonzero(rest)))
        if self._batches == 0:
            raise ValueError(f"no group has batch_size={self.batch_size} samples: with drop_last=True "
                             f"every epoch would be empty (largest group: {int(sizes.max())})")
        digest = hashlib.sha256(group_of.astype(np.int64).tobytes()).hexdigest()[:16]
        self.fingerprint = (f"GroupedBatchSampler groups={keys.size}:{digest} batch_size={self.batch_size} "
                            f"drop_last={drop_last} shuffle={self.shuffle}")
        self._epoch_cache: tuple[int, int, list[np.ndarray]] | None = None

    def __len__(self) -> int:
        """Batches per epoch (the same every epoch)."""
        return self._batches

    def batches_at(self, seed: int, epoch: int, steps: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """The int64 sample indices of the batches at `steps` of `epoch` (each in [0, len))."""
        batches = self._epoch(seed, epoch)
        out = []
        for step in np.asarray(steps, dtype=np.int64).tolist():
            if not 0 <= step < len(batches):
                raise IndexError(f"step {step} is not in [0, {len(batches)})")
            out.append(batches[step])
        return out

    def _epoch(self, seed: int, epoch: int) -> list[np.ndarray]:
        cached = self._epoch_cache
        if cached is not None and cached[:2] == (seed, epoch):
            return cached[2]
        batches: list[np.ndarray] = []
        for g in range(self.starts.size - 1):
            group = self.members[self.starts[g]:self.starts[g + 1]]
            if self.shuffle:
                group = group[keyed_permutation(group.size, derive_key(TAG_GROUPED, seed, epoch, g))]
            stop = group.size - group.size % self.batch_size if self.drop_last else group.size
            batches.extend(group[i:i + self.batch_size] for i in range(0, stop, self.batch_size))
        if self.shuffle:
            batches = [batches[i] for i in keyed_permutation(len(batches), derive_key(TAG_GROUPED, seed, epoch))]
        for batch in batches:
            batch.flags.writeable = False
        self._epoch_cache = (seed, epoch, batches)
        return batches

    def set_epoch(self, epoch: int) -> None:
        """The epoch this sampler yields when iterated on its own (e.g. by a DataLoader)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self._epoch(self.seed, self.epoch):
            yield batch.tolist()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_epoch_cache"] = None
        return state

    def __repr__(self) -> str:
        return f"GroupedBatchSampler({self.fingerprint})"
