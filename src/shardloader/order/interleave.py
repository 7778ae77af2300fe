"""A deterministic interleave of several sources by weight, computable at any position.

Stride scheduling (the Sainte-Laguë / Webster order): with weights w_i normalised to sum 1,
source i's k-th draw (k = 0, 1, ...) sits at time `(k + 1/2) / w_i`, and the sequence is every
draw sorted by (time, source index): at equal times the source listed first goes first. A
source of weight 0 is never drawn.

What a position costs. `interleave(weights, positions)` gives, for each position q, how many
draws of each source come before it and which source q itself draws, without walking the
sequence: at time t each source has made ceil(t w_i - 1/2) draws, within 1/2 of t w_i, so the
q-th draw lies within S/2 + 2 of time q (S: sources of positive weight). The draws made before
that window are counted directly; the draws inside it (about 3 S of them) are sorted and
counted. O(S log S) per position, vectorised over positions, and never an O(q) array.

How even it is. Over any prefix of p positions, source i has drawn c_i with
`|c_i - w_i p| <= 1/2 + (S - 1) w_i / 2` (the draws before time t are within 1/2 of t w_i each,
and the prefix's end time is within S/2 of p): within 1 of its share for two or three sources,
and for more sources whenever no weight exceeds 1/(S - 1). `tests/test_mixture.py` checks the
bound on every prefix.

Event times are float64 `(k + 0.5) / w_i` (`event_time`), and every count here compares those
very floats, so the sequence is one exact, platform-independent (IEEE) function of the weights.
"""

from __future__ import annotations

import numpy as np


def normalized(weights: np.ndarray | list[float]) -> np.ndarray:
    """Weights as float64 summing to 1. Raises ValueError for a negative, non-finite or
    all-zero weight vector."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("weights: need one weight per source, at least one source")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be finite and >= 0; got {w.tolist()}")
    total = w.sum()
    if total <= 0:
        raise ValueError(f"weights: at least one must be positive; got {w.tolist()}")
    return w / total


def event_time(k: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Time of draw `k` of a source of (normalised) weight `w`: the one definition of time."""
    return (np.asarray(k, dtype=np.int64).astype(np.float64) + 0.5) / w


def draws_before_time(w: np.ndarray, t: np.ndarray) -> np.ndarray:
    """(P, S) int64: per time t_p and source i (weights `w` > 0), the draws with time < t_p."""
    t = np.asarray(t, dtype=np.float64)[:, None]
    k = np.maximum(np.ceil(t * w[None, :] - 0.5), 0).astype(np.int64)
    while True:  # correct the float estimate against event_time itself (at most a step or two)
        down = (k > 0) & (event_time(k - 1, w) >= t)
        up = event_time(k, w) < t
        if not (down.any() or up.any()):
            return k
        k = k - down + up


#: Position sets at least this large, spanning at most `_DENSE_SPAN` times their size, are
#: computed as one contiguous stretch (`_dense`): the Loader asks for blocks of 64 steps, and
#: one sort of the stretch's draws costs a fraction of a sort per position (4,096 positions of
#: two sources: 0.6 ms against 6.5 ms on this project's 2-core machine).
_DENSE_MIN, _DENSE_SPAN = 64, 4


def interleave(weights: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each position q: (draws of each source before q, shape (P, S); the source drawn
    at q, shape (P,)). `weights` need not be normalised; a zero weight is never drawn."""
    w_all = normalized(weights)
    q = np.asarray(positions, dtype=np.int64).ravel()
    if q.size and q.min() < 0:
        raise ValueError("interleave: positions must be >= 0")
    if q.size >= _DENSE_MIN and q.max() - q.min() < _DENSE_SPAN * q.size:
        dense = _dense(w_all, int(q.min()), int(q.max()) + 1)
        if dense is not None:
            counts, source = dense
            return counts[q - q.min()], source[q - q.min()]
    return _windowed(w_all, q)


def _dense(w_all: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`interleave` of every position in [start, stop): the draws before `start` counted
    (`_windowed`), then the stretch's draws sorted once. None if the draws taken per source
    fell short (then the caller computes position by position)."""
    before, _ = _windowed(w_all, np.array([start], dtype=np.int64))
    active = np.flatnonzero(w_all > 0)
    w = w_all[active]
    span = np.ceil((stop - start) * w).astype(np.int64) + 2
    col_source = np.repeat(np.arange(active.size), span)  # in source order: ties go to the first
    col_k = np.concatenate([np.arange(n) for n in span.tolist()])
    first = before[0, active]
    times = event_time(first[col_source] + col_k, w[col_source])
    order = np.argsort(times, kind="stable")[:stop - start]
    if times[order[-1]] >= event_time(first + span, w).min():
        return None
    drawn = col_source[order]
    onehot = drawn[:, None] == np.arange(active.size)[None, :]
    counts = np.zeros((stop - start, w_all.size), dtype=np.int64)
    counts[1:, active] = np.cumsum(onehot[:-1], axis=0)
    counts += before[0][None, :]
    return counts, active[drawn]


def _windowed(w_all: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`interleave` position by position (each its own window of draws)."""
    active = np.flatnonzero(w_all > 0)
    w = w_all[active]
    s = active.size
    start = np.maximum(q - s / 2.0 - 2.0, 0.0)  # before the window holding position q
    lo = draws_before_time(w, start)  # (P, s)
    span = np.ceil((s + 4) * w).astype(np.int64) + 1  # each source's draws in the window
    col_source = np.repeat(np.arange(s), span)  # columns in source order: ties go to the first
    col_k = np.concatenate([np.arange(n) for n in span.tolist()])
    times = event_time(lo[:, col_source] + col_k, w[col_source])
    order = np.argsort(times, axis=1, kind="stable")
    sorted_source = col_source[order]
    taken = q - lo.sum(axis=1)  # window draws before q
    rows = np.arange(q.size)
    end = event_time(lo + span, w).min(axis=1)  # every draw before `end` is in the window
    if q.size and (taken.min() < 0 or taken.max() >= order.shape[1]
                   or np.any(times[rows, order[rows, taken]] >= end)):
        raise AssertionError("interleave: the window missed a position (a bug in its bounds)")
    before = np.arange(order.shape[1])[None, :] < taken[:, None]
    counts = np.zeros((q.size, w_all.size), dtype=np.int64)
    for i in range(s):
        counts[:, active[i]] = lo[:, i] + np.count_nonzero(before & (sorted_source == i), axis=1)
    return counts, active[sorted_source[rows, taken]]


def position_of_draw(weights: np.ndarray, source: int, k: int) -> int:
    """The position of source `source`'s draw `k` (0-based) in the interleave of `weights`."""
    w_all = normalized(weights)
    if w_all[source] <= 0:
        raise ValueError(f"source {source} has weight 0: it is never drawn")
    active = np.flatnonzero(w_all > 0)
    w = w_all[active]
    t = event_time(np.array([k]), np.array([w_all[source]]))[0]
    before = draws_before_time(w, np.array([t]))[0]
    tied = (event_time(before, w) == t) & (active < source)  # listed first: drawn first
    return int(before.sum() + np.count_nonzero(tied))
