"""Counter-based 64-bit keys and mixing: the randomness behind order and augmentation.

Everything random in shardloader is a pure function of integers (seed, epoch, shard,
window, piece, sample index) through the mixers below, never a stateful generator stream. That is
what makes order and augmentation independent of worker count, world size and restarts
(invariants I1 and I3), and stable across numpy/torch versions (we do not rely on any
library's generator algorithm for order).

The mixer is the splitmix64 finaliser (Steele, Lea & Flood 2014), applied to numpy uint64
arrays, where multiplication wraps modulo 2**64 as it should.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def mix64(x: int) -> int:
    """splitmix64 finaliser on a Python int (a bijection of 64-bit integers)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * _M1) & MASK64
    x = ((x ^ (x >> 27)) * _M2) & MASK64
    return x ^ (x >> 31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (vectorised, wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    if x.ndim == 0:  # numpy scalar arithmetic warns when it wraps; array arithmetic never does
        with np.errstate(over="ignore"):
            return _mix(x)
    # No errstate here: entering it costs about as much as mixing a batch's keys, and one
    # batch's order calls this ~60 times (measured: 0.74 -> 0.56 ms per 64-sample batch).
    return _mix(x)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int) -> int:
    """A 64-bit key from a tuple of non-negative integers; distinct tuples give unrelated keys."""
    key = 0x243F6A8885A308D3  # fixed domain constant
    for part in parts:
        key = mix64((key + _GOLDEN + (int(part) & MASK64)) & MASK64)
        key = mix64(key ^ (int(part) >> 64))  # parts wider than 64 bits still matter
    return key


def derive_keys(base: int, parts: np.ndarray) -> np.ndarray:
    """Vectorised `derive_key(base, part)` analogue: one key per element of `parts`."""
    base_arr = np.uint64(mix64(base))
    with np.errstate(over="ignore"):
        x = mix64_array(base_arr + np.uint64(_GOLDEN) + np.asarray(parts, dtype=np.uint64))
    return mix64_array(x ^ base_arr)


# Tags keep the key spaces of different uses apart.
TAG_SHARDS = 1  # order version 1's shard permutation; kept so the value is never reused
TAG_WINDOW = 2
TAG_SAMPLE = 3
TAG_ROTATE = 4
TAG_ROWS = 5
TAG_PIECES = 6
TAG_WRITE = 7  # the order `write_shards(shuffle=True)` writes samples in
TAG_WEIGHTED = 8  # WeightedSampler's draws
TAG_GROUPED = 9  # GroupedBatchSampler's shuffles
TAG_MIXTURE = 10  # a Mixture's per-pass permutations of each source
