"""numpy helpers of the read path: same results as numpy, without importing numpy.ma."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from shardloader.format.arrays import positions_by_value, sorted_unique

ONE_DIMENSIONAL = [
    np.array([], dtype=np.int64),
    np.array([7], dtype=np.int64),
    np.array([5, 1, 5, 2, 1, 9, 9, 0], dtype=np.int64),
    np.arange(50)[::-1].copy(),
    np.array([3, 3, 3], dtype=np.int32),
]


@pytest.mark.parametrize("values", [*ONE_DIMENSIONAL, np.array([[4, 1], [4, 2]])])
def test_sorted_unique_is_numpys_unique(values):
    got = sorted_unique(values)
    want = np.unique(values)
    assert got.dtype == want.dtype
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("values", [
    *ONE_DIMENSIONAL,
    np.random.default_rng(0).integers(0, 13, size=64),  # a batch's shards
    np.random.default_rng(1).integers(0, 3, size=1000),
])
def test_positions_by_value_groups_positions_in_order(values):
    got = positions_by_value(values)
    want = [(v, np.flatnonzero(values == v)) for v in sorted_unique(values).tolist()]
    assert [value for value, _ in got] == [value for value, _ in want]
    assert all(type(value) is int for value, _ in got)
    assert [positions.tolist() for _, positions in got] == [positions.tolist() for _, positions in want]


def test_reading_rows_imports_neither_numpy_ma_nor_pandas(arrow_dataset, parquet_dataset):
    """Both cost tens of ms and MiB in every process that reads (each worker too)."""
    script = (
        "import sys\n"
        "from shardloader import Dataset\n"
        f"for root in ({arrow_dataset.path!r}, {parquet_dataset.path!r}):\n"
        "    ds = Dataset(root)\n"
        "    ds.get_many([len(ds) - 1, 0, 3, 0])\n"
        "print(sorted(m for m in ('numpy.ma', 'pandas') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
