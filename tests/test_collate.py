"""`collate` gives exactly what torch's default_collate gives: the same container types and the
same tensors, bit for bit, for every sample shape a DataLoader user has."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shardloader.loader.collate import collate

Point = namedtuple("Point", ["x", "y"])


def assert_identical(a, b, path="batch"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert a.numpy().tobytes() == b.numpy().tobytes(), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


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
