"""Per-sample randomness for augmentation: a pure function of (seed, epoch, sample index).

Invariant I3: the random draws used to augment sample g in epoch e depend only on
(seed, epoch, g). A transform that accepts a `generator` keyword gets a `torch.Generator`
seeded from that key; for transforms that use global generators instead, `random`,
`numpy.random` and torch's global generator are seeded from the same key while the transform
runs, and the process's previous states are restored afterwards (`GlobalRngScope`), so the
worker's own streams are left as they were.
"""

from __future__ import annotations

from types import TracebackType

import numpy as np
import torch

from shardloader.order.global_rngs import (
    restore_streams,
    save_streams,
    seed_numpy,
    seed_python,
    seed_torch,
)
from shardloader.order.keys import _GOLDEN, TAG_SAMPLE, derive_key, mix64_array


def sample_key(seed: int, epoch: int, sample: int) -> int:
    """The 64-bit key of sample `sample` in epoch `epoch` under `seed`."""
    return derive_key(TAG_SAMPLE, seed, epoch, sample)


def sample_keys(seed: int, epoch: int, samples: np.ndarray) -> list[int]:
    """`sample_key(seed, epoch, s)` for every s in `samples` (0 <= s < 2**64), vectorised.

    A loader worker needs one key per sample; this costs about a microsecond each instead of
    ~20 in pure Python. `derive_key` folds its parts in order, so the keys share the prefix
    `derive_key(TAG_SAMPLE, seed, epoch)` and the last step, for a part below 2**64, is
    mix64(mix64(prefix + golden + s) ^ 0).
    """
    prefix = np.uint64(derive_key(TAG_SAMPLE, seed, epoch))
    with np.errstate(over="ignore"):
        x = prefix + np.uint64(_GOLDEN) + np.asarray(samples, dtype=np.uint64)
    return mix64_array(mix64_array(x)).tolist()


def sample_generator(key: int) -> torch.Generator:
    """A CPU torch.Generator seeded from `key` (torch seeds take 64 bits)."""
    generator = torch.Generator()
    generator.manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


class GlobalRngScope:
    """Seeds the global RNGs per sample inside a block and restores the previous states at exit.

    Use one scope per batch and call `seed(key)` before each sample: the save/restore cost is
    paid once per batch, the seeding once per sample.
    """

    def __enter__(self) -> GlobalRngScope:
        self._streams = save_streams()
        return self

    def seed(self, key: int) -> None:
        seed_python(key)
        seed_numpy(key)
        seed_torch(key)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        restore_streams(self._streams)
