"""Keyed pseudo-random permutations, computable one element at a time.

`feistel_permute(x, n, keys)` maps each `x` in [0, n) to its image under a permutation of
[0, n) chosen by its key: a 4-round balanced Feistel network over the smallest even-bit domain
covering n, with cycle walking to stay inside [0, n). It needs O(1) memory and time per element,
which is what lets the loader compute any position of an epoch without an O(N) array.

`affine_permute(x, n, a, b)` is the cheap one, (a * x + b) mod n with gcd(a, n) = 1: the order
uses it per shard to decide which rows travel together (the Feistel permutation of each window
then makes the order within a window uniformly random), at a tenth of a Feistel's cost.

`keyed_permutation(n, key)` materialises a whole permutation (sorting keyed hashes); the order
module uses it only for the shard order (O(shards), not O(samples)).
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


def _feistel_rounds(y: np.ndarray, half: np.ndarray, keys: np.ndarray) -> np.ndarray:
    mask = (np.uint64(1) << half) - np.uint64(1)
    left = y >> half
    right = y & mask
    with np.errstate(over="ignore"):
        for r in range(_ROUNDS):
            round_key = mix64_array(keys + np.uint64(r + 1) * np.uint64(0x9E3779B97F4A7C15))
            f = mix64_array(right ^ round_key) & mask
            left, right = right, left ^ f
    return (left << half) | right


def feistel_permute(x: np.ndarray, n: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Image of each x[i] in [0, n[i]) under the permutation of [0, n[i]) keyed by keys[i].

    Arrays broadcast together. n[i] must be >= 1 and x[i] < n[i].
    """
    x, n, keys = np.broadcast_arrays(
        np.asarray(x, dtype=np.int64), np.asarray(n, dtype=np.int64), np.asarray(keys, dtype=np.uint64)
    )
    if x.size == 0:
        return x.astype(np.int64)
    if np.any(x < 0) or np.any(x >= n):
        raise ValueError("feistel_permute: every x must lie in [0, n)")
    half = (_domain_bits(n) // 2).astype(np.uint64)
    y = x.astype(np.uint64)
    n_u = n.astype(np.uint64)
    todo = np.arange(y.size)
    y = y.ravel().copy()
    half_f, keys_f, n_f = half.ravel(), keys.ravel(), n_u.ravel()
    # Cycle walking: re-apply the permutation of the power-of-two domain until inside [0, n).
    while todo.size:
        y[todo] = _feistel_rounds(y[todo], half_f[todo], keys_f[todo])
        todo = todo[y[todo] >= n_f[todo]]
    return y.reshape(x.shape).astype(np.int64)


def affine_keys(n: np.ndarray, key: int) -> tuple[np.ndarray, np.ndarray]:
    """Per element of `n`, a multiplier a coprime to n[i] and an offset b, both in [0, n[i]),
    keyed by (key, i). Multipliers are drawn from [n/8, 7n/8) (when n > 16), away from the
    near-identity maps whose images of a range stay clustered."""
    n = np.asarray(n, dtype=np.int64)
    if np.any(n >= 1 << 32):
        raise ValueError("affine_keys: sizes must stay below 2**32 (a shard's row count)")
    size = np.maximum(n, 1).astype(np.uint64)
    idx = np.arange(n.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h1 = mix64_array(idx * np.uint64(2) + np.uint64(key))
        h2 = mix64_array(idx * np.uint64(2) + np.uint64(1) + np.uint64(key))
    span = np.where(n > 16, (size * np.uint64(3)) // np.uint64(4), size)
    low = np.where(n > 16, size // np.uint64(8), np.uint64(0))
    a = (low + h1 % span).astype(np.int64)
    b = (h2 % size).astype(np.int64)
    a = np.where(n > 1, np.maximum(a, 1), 0)
    while True:  # the next coprime multiplier: a few steps at most (one in ~1.6 numbers)
        bad = (n > 1) & (np.gcd(a, n) != 1)
        if not bad.any():
            break
        a = np.where(bad, a % np.maximum(n, 1) + 1, a)  # wraps in [1, n]; gcd(n, n) = n > 1
    return a, b


def affine_permute(x: np.ndarray, n: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a * x + b) mod n elementwise: a permutation of [0, n) when gcd(a, n) = 1 (n < 2**32)."""
    x, n, a, b = (np.asarray(v, dtype=np.uint64) for v in (x, n, a, b))
    with np.errstate(over="ignore"):
        return ((a * x + b) % np.maximum(n, np.uint64(1))).astype(np.int64)

