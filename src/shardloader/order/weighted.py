"""`WeightedSampler`: per-sample weights, as torch's WeightedRandomSampler, as a pure function
of (seed, epoch, position) — a PureSampler (see `shardloader.loader.protocol`), so a Loader
resumes it exactly in O(1) under any num_workers and world size.

- With replacement: the sample at a position is the weights' inverse CDF at a keyed uniform
  of (seed, epoch, position): O(1) per position (one binary search), no per-epoch array.
- Without replacement: Efraimidis-Spirakis weighted sampling — every sample draws a keyed
  exponential key log(u_i) / w_i, and the epoch is the `num_samples` largest keys in
  decreasing order (a weighted random permutation of a weighted random subset). That needs the
  whole epoch: it is made once per epoch and process (O(N log k)) and kept for the last epoch
  asked for (a worker computes the batches of one epoch at a time).

The draws are not torch's (torch.multinomial's stream cannot be computed for one position);
what they follow is the same distribution. No torch here: numpy only.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from shardloader.order.keys import TAG_WEIGHTED, derive_key, derive_keys


def keyed_uniforms(key: int, positions: np.ndarray) -> np.ndarray:
    """A float64 in [0, 1) for each position, a pure function of (key, position): the top 53
    bits of its keyed 64-bit hash."""
    bits = derive_keys(key, np.asarray(positions, dtype=np.int64).astype(np.uint64)) >> np.uint64(11)
    return bits.astype(np.float64) * (1.0 / (1 << 53))


def check_count(name: str, value: Any) -> int:
    """`value` as a positive int, or ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} should be a positive integer value, but got {name}={value!r}")
    return int(value)


class WeightedSampler:
    """Samples indices 0..len(weights)-1 with probability proportional to `weights`,
    `num_samples` per epoch, with or without `replacement` (WeightedRandomSampler's arguments).

    Given to a Loader as `sampler=`, its epochs are a pure function of the Loader's seed and
    epoch. Iterated on its own (e.g. by a DataLoader), it uses `seed` and the epoch last set by
    `set_epoch` (0 by default), and yields exactly what a Loader with that seed reads."""

    def __init__(self, weights: Sequence[float] | np.ndarray, num_samples: int, replacement: bool = True,
                 *, seed: int = 0) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or w.size == 0:
            raise ValueError(f"weights must be a non-empty 1-D sequence of numbers, got shape {w.shape}")
        bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
        if bad.size:
            raise ValueError(f"weights[{int(bad[0])}] is {w[bad[0]]!r}: weights must be finite and "
                             f"non-negative")
        if not w.sum() > 0:
            raise ValueError("weights sum to 0: at least one sample needs a positive weight")
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got replacement={replacement!r}")
        self.num_samples = check_count("num_samples", num_samples)
        positive = int(np.count_nonzero(w))
        if not replacement and self.num_samples > positive:
            raise ValueError(
                f"num_samples={self.num_samples} without replacement, but only {positive} weights "
                f"are positive: pass replacement=True or num_samples <= {positive}")
        self.weights = w
        self.weights.flags.writeable = False
        self.replacement = replacement
        self.seed = int(seed)
        self.epoch = 0
        self._cdf = np.cumsum(w)
        digest = hashlib.sha256(w.tobytes()).hexdigest()[:16]
        self.fingerprint = (f"WeightedSampler weights={w.size}:{digest} num_samples={self.num_samples} "
                            f"replacement={replacement}")
        self._epoch_cache: tuple[int, int, np.ndarray] | None = None  # (seed, epoch, samples)

    def __len__(self) -> int:
        return self.num_samples

    def samples_at(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """int64 sample indices at epoch `positions` (each in [0, num_samples))."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and (p.min() < 0 or p.max() >= self.num_samples):
            raise IndexError(f"positions must lie in [0, {self.num_samples})")
        if self.replacement:
            u = keyed_uniforms(derive_key(TAG_WEIGHTED, seed, epoch), p)
            found = np.searchsorted(self._cdf, u * self._cdf[-1], "right")
            return np.minimum(found, self.weights.size - 1).astype(np.int64)
        return self._epoch(seed, epoch)[p]

    def _epoch(self, seed: int, epoch: int) -> np.ndarray:
        """The whole epoch without replacement (Efraimidis-Spirakis), kept for one epoch."""
        cached = self._epoch_cache
        if cached is not None and cached[:2] == (seed, epoch):
            return cached[2]
        u = keyed_uniforms(derive_key(TAG_WEIGHTED, seed, epoch, 1), np.arange(self.weights.size))
        with np.errstate(divide="ignore"):
            keys = np.log1p(-u) / self.weights  # log(1 - u) in (-inf, 0]; weight 0: -inf
        k = self.num_samples
        top = np.argpartition(-keys, k - 1)[:k] if k < keys.size else np.arange(keys.size)
        samples = top[np.lexsort((top, -keys[top]))].astype(np.int64)  # ties: lower index first
        samples.flags.writeable = False
        self._epoch_cache = (seed, epoch, samples)
        return samples

    def set_epoch(self, epoch: int) -> None:
        """The epoch this sampler yields when iterated on its own."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.samples_at(self.seed, self.epoch, np.arange(self.num_samples)).tolist())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_epoch_cache"] = None  # made again where it is needed
        return state

    def __repr__(self) -> str:
        return f"WeightedSampler({self.fingerprint})"
