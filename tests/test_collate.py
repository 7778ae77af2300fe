"""`collate` gives exactly what torch's default_collate gives: the same container types and the
same tensors, bit for bit, for every sample shape a DataLoader user has."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shardloader.loader.collate import collate
from tests.resume import assert_identical

Point = namedtuple("Point", ["x", "y"])


def _samples(kind: str, n: int = 5) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        image = torch.randn(3, 4, 4, generator=g)
        if kind == "tensor_int":
            out.append((image, i))
        elif kind == "numpy_float_str":
            out.append((image.numpy(), float(i) / 3, f"name-{i}"))
        elif kind == "list":
            out.append([image.to(torch.uint8), np.int64(i), True])
        elif kind == "nested":
            out.append({"x": (image, {"label": i}), "meta": [i, i + 1]})
        elif kind == "namedtuple":
            out.append(Point(image, i))
        elif kind == "dict_of_arrays":
            out.append({"image": image.numpy().astype(np.uint8), "label": i})
    return out


@pytest.mark.parametrize("kind", ["tensor_int", "numpy_float_str", "list", "nested", "namedtuple",
                                  "dict_of_arrays"])
def test_collate_is_default_collate(kind):
    samples = _samples(kind)
    assert_identical(collate(samples), default_collate(samples))


def test_tuple_samples_become_a_list_of_columns_like_dataloader():
    images, labels = collate(_samples("tensor_int"))
    assert images.shape == (5, 3, 4, 4) and labels.dtype == torch.int64
    assert type(collate(_samples("tensor_int"))) is list


def test_uneven_samples_raise_default_collates_error():
    with pytest.raises(RuntimeError, match="equal size"):
        collate([(torch.zeros(2), 1), (torch.zeros(2),)])
    with pytest.raises(RuntimeError):
        collate([(torch.zeros(2), 1), (torch.zeros(3), 1)])


def _records(kind: str, n: int = 5):
    rng = np.random.default_rng(7)
    if kind == "images":
        return [{"image": rng.integers(0, 256, (6, 5, 3), dtype=np.uint8), "label": i,
                 "__index__": 100 + i} for i in range(n)]
    if kind == "mixed":
        return [{"f32": rng.random((2, 3), dtype=np.float32), "f64": float(i) / 3,
                 "flag": bool(i % 2), "name": f"s{i}", "scalar": np.array(i, dtype=np.int16),
                 "bools": rng.random(4) > 0.5, "tensor": torch.arange(i, i + 3),
                 "half": torch.full((2,), i, dtype=torch.float16),
                 "nested": {"c64": (rng.random(2) + 1j).astype(np.complex64), "k": i}}
                for i in range(n)]
    if kind == "tuples":
        return [(rng.integers(0, 9, (3,), dtype=np.int64), i) for i in range(n)]
    if kind == "big-endian":
        return [{"x": np.arange(3, dtype=">i4")} for _ in range(n)]
    if kind == "non-contiguous":
        return [{"x": rng.random((4, 6))[:, ::2], "t": torch.arange(12).view(3, 4).t()}
                for _ in range(n)]
    if kind == "bfloat16":
        return [{"x": torch.full((3,), 1.5 + i, dtype=torch.bfloat16)} for i in range(n)]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["images", "mixed", "tuples", "big-endian", "non-contiguous",
                                  "bfloat16"])
def test_collate_gives_default_collates_batch_or_error(kind):
    records = _records(kind)
    try:
        expected = default_collate(records)
    except Exception as e:  # noqa: BLE001 - then ours must fail the same way
        with pytest.raises(type(e)) as ours:
            collate(records)
        assert str(ours.value) == str(e)
    else:
        assert_identical(collate(records), expected)


def test_collate_of_mismatched_shapes_fails_like_default_collate():
    records = [{"x": np.zeros((2, 2), np.uint8)}, {"x": np.zeros((3, 2), np.uint8)}]
    with pytest.raises(RuntimeError) as expected:
        default_collate(records)
    with pytest.raises(RuntimeError) as ours:
        collate(records)
    assert str(ours.value) == str(expected.value)


def test_collate_of_dicts_with_different_keys_fails_like_default_collate():
    records = [{"x": np.zeros(2)}, {"y": np.zeros(2)}]
    with pytest.raises(KeyError):
        default_collate(records)
    with pytest.raises(KeyError):
        collate(records)
