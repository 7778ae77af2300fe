"""Small numpy helpers for the read path, written to stay off numpy's lazy imports.

`numpy.unique(a)` (numpy 2.x) calls `np.ma.is_masked`, and the first such call imports
`numpy.ma`: 40-80 ms of CPU and a few MiB in every process that reads a batch (the
training process and each worker), for arrays that are never masked.
"""

from __future__ import annotations

import numpy as np


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D array, ascending: `numpy.unique(values)` without its
    masked-array check (and so without importing numpy.ma)."""
    values = np.sort(np.asarray(values).ravel())
    if values.size < 2:
        return values
    keep = np.empty(values.size, dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def positions_by_value(values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """[(value, positions)] for each distinct value of a 1-D int array, values ascending and
    each value's positions ascending: the same groups as `[(v, np.flatnonzero(values == v))
    for v in sorted_unique(values)]`, from one stable sort instead of one scan per value
    (a batch's samples group by shard this way in every read)."""
    values = np.asarray(values).ravel()
    if values.size == 0:
        return []
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist()]
    ends = [*starts[1:], values.size]
    firsts = ordered[starts].tolist()
    return [(value, order[start:end]) for value, start, end in zip(firsts, starts, ends)]
