"""Keyed pseudo-random permutations, computable one element at a time.

`feistel_permute(x, n, keys)` maps each `x` in [0, n) to its image under a permutation of
[0, n) chosen by its key: a 4-round balanced Feistel network over the smallest even-bit domain
covering n, with cycle walking to stay inside [0, n). It needs O(1) memory and time per element,
which is what lets the loader compute any position of an epoch without an O(N) array.

`keyed_permutation(n, key)` materialises a whole permutation (sorting keyed hashes): O(n)
memory, for small n or reference computations (tests, benchmarks), never per epoch of samples.
"""

from __future__ import annotations

import numpy as np

from shardloader.order.keys import mix64_array

_ROUNDS = 4


def keyed_permutation(n: int, key: int) -> np.ndarray:
    """A permutation of range(n) as an int64 array, a pure function of (n, key)."""
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    with np.errstate(over="ignore"):
        hashed = mix64_array(np.arange(n, dtype=np.uint64) + np.uint64(key))
        hashed = mix64_array(hashed ^ np.uint64(key))
    return np.argsort(hashed, kind="stable").astype(np.int64)


def _domain_bits(n: np.ndarray) -> np.ndarray:
    """Per element: the even number of bits b >= 2 with 2**b >= n."""
    n = np.maximum(n, 2)
    bits = np.ceil(np.log2(n.astype(np.float64))).astype(np.int64)
    # float log2 can round for n near powers of two: correct it exactly.
    bits = np.where((np.int64(1) << bits) < n, bits + 1, bits)
    bits = np.where((bits > 1) & ((np.int64(1) << (bits - 1)) >= n), bits - 1, bits)
    return bits + (bits & 1)


def _round_keys(keys: np.ndarray) -> list[np.ndarray]:
    with np.errstate(over="ignore"):
        return [mix64_array(keys + np.uint64(r + 1) * np.uint64(0x9E3779B97F4A7C15)) for r in range(_ROUNDS)]


def _feistel_rounds(y: np.ndarray, half: np.ndarray, round_keys: list[np.ndarray]) -> np.ndarray:
    mask = (np.uint64(1) << half) - np.uint64(1)
    left = y >> half
    right = y & mask
    for round_key in round_keys:
        f = mix64_array(right ^ round_key) & mask
        left, right = right, left ^ f
    return (left << half) | right


def feistel_permute(x: np.ndarray, n: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Image of each x[i] in [0, n[i]) under the permutation of [0, n[i]) keyed by keys[i].

    Arrays broadcast together. n[i] must be >= 1 and x[i] < n[i].
    """
    one_key = np.ndim(keys) == 0 and np.ndim(n) == 0  # a whole array under one permutation
    x, n, keys = np.broadcast_arrays(
        np.asarray(x, dtype=np.int64), np.asarray(n, dtype=np.int64), np.asarray(keys, dtype=np.uint64)
    )
    if x.size == 0:
        return x.astype(np.int64)
    if np.any(x < 0) or np.any(x >= n):
        raise ValueError("feistel_permute: every x must lie in [0, n)")
    half = (_domain_bits(n) // 2).astype(np.uint64).ravel()
    y = x.astype(np.uint64).ravel().copy()
    n_f = n.astype(np.uint64).ravel()
    if one_key:  # the round keys mixed once, not once per element (a mixture's pass)
        round_keys = [np.broadcast_to(k, y.shape) for k in _round_keys(keys.ravel()[:1])]
    else:
        round_keys = _round_keys(keys.ravel())
    # Cycle walking: re-apply the permutation of the power-of-two domain until inside [0, n).
    y = _feistel_rounds(y, half, round_keys)
    todo = np.flatnonzero(y >= n_f)
    while todo.size:
        y[todo] = _feistel_rounds(y[todo], half[todo], [k[todo] for k in round_keys])
        todo = todo[y[todo] >= n_f[todo]]
    return y.reshape(x.shape).astype(np.int64)

