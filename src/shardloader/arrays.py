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
