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


# -- BatchBuilder: collate one sample at a time, arrays straight into the batch tensors --------


def _built(samples, allocate=None):
    from shardloader.loader.collate import BatchBuilder

    builder = BatchBuilder(len(samples), allocate)
    for sample in samples:
        builder.add(sample)
    return builder.finish()


def _assert_builds_like_collate(samples, allocate=None):
    """The builder's batch is collate's (and default_collate's) in types, keys, dtypes, shapes,
    bytes and strides; or it fails with the same error."""
    try:
        expected = collate(samples)
    except Exception as e:  # noqa: BLE001 - then the builder must fail the same way
        with pytest.raises(type(e)) as ours:
            _built(samples, allocate)
        assert str(ours.value) == str(e)
        return None
    batch = _built(samples, allocate)
    assert_identical(batch, expected)
    assert_identical(batch, default_collate(samples))

    def strides(x):
        if isinstance(x, torch.Tensor):
            return x.stride()
        if isinstance(x, dict):
            return {k: strides(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [strides(v) for v in x]
        return None

    assert strides(batch) == strides(expected)
    return batch


def _changed(kind: str, at: int, n: int = 6):
    """Records whose sample `at` differs from the first ones in one way (`kind`)."""
    rng = np.random.default_rng(at)
    records = [{"img": torch.from_numpy(rng.integers(0, 256, (3, 4, 5), dtype=np.uint8)),
                "x": rng.random(3).astype(np.float32), "label": i, "name": f"s{i}"}
               for i in range(n)]
    r = records[at]
    if kind == "shape":
        r["img"] = torch.zeros(3, 4, 6, dtype=torch.uint8)
    elif kind == "dtype":
        r["x"] = r["x"].astype(np.float64)
    elif kind == "array-for-tensor":
        r["img"] = r["img"].numpy()
    elif kind == "tensor-for-array":
        r["x"] = torch.from_numpy(r["x"])
    elif kind == "keys":
        r["extra"] = 1
    elif kind == "missing":
        del r["label"]
    elif kind == "grad":
        r["x"] = torch.from_numpy(r["x"]).requires_grad_()
    elif kind == "non-contiguous":
        r["img"] = torch.zeros(3, 5, 4, dtype=torch.uint8).transpose(1, 2)
    elif kind == "int-for-array":
        r["x"] = 7
    elif kind == "chw-view":  # ToTensor's layout: a CHW view of HWC pixels (copied by OpenCV)
        r["img"] = torch.from_numpy(np.ascontiguousarray(r["img"].numpy().transpose(1, 2, 0))).permute(2, 0, 1)
    elif kind == "conj":
        r["x"] = torch.from_numpy(r["x"].astype(np.complex64)).conj()
    elif kind == "order":  # the same keys in another order: not a difference for collate
        records[at] = dict(reversed(list(r.items())))
    return records


@pytest.mark.parametrize("kind", ["shape", "dtype", "array-for-tensor", "tensor-for-array", "keys",
                                  "missing", "grad", "non-contiguous", "int-for-array", "chw-view",
                                  "conj", "order"])
@pytest.mark.parametrize("at", [0, 1, 5])
def test_batch_builder_is_collate_whatever_changes_within_the_batch(kind, at):
    """A sample that differs from the first (shape, dtype, type, keys) turns the batch back
    into samples: collate's batch or error, whichever sample it is."""
    _assert_builds_like_collate(_changed(kind, at))


@pytest.mark.parametrize("kind", ["tensor_int", "numpy_float_str", "list", "nested", "namedtuple",
                                  "dict_of_arrays"])
def test_batch_builder_is_collate_for_every_sample_kind(kind):
    _assert_builds_like_collate(_samples(kind))


@pytest.mark.parametrize("kind", ["images", "mixed", "tuples", "big-endian", "non-contiguous",
                                  "bfloat16"])
def test_batch_builder_is_collate_for_records(kind):
    _assert_builds_like_collate(_records(kind))


def test_batch_builder_keeps_collates_column_types_for_strings_and_odd_values():
    """Strings come back as the column collate gives (a list under a dict, a tuple under a
    sequence); zero-size arrays, 0-d arrays, numpy scalars, None-free odd values collate as
    collate does; nesting to any depth."""
    samples = [{"name": f"s{i}", "pair": (f"p{i}", np.zeros((0, 3), np.float32)),
                "scalar": np.array(i, np.int16), "np_int": np.int64(i), "flag": bool(i % 2),
                "deep": [{"t": torch.full((2,), float(i))}, (np.arange(3) + i,)],
                "bytes": b"x" * i}
               for i in range(4)]
    batch = _assert_builds_like_collate(samples)
    assert type(batch["name"]) is list and type(batch["pair"][0]) is tuple
    assert batch["deep"][0]["t"].shape == (4, 2)


def test_batch_builder_writes_arrays_into_the_allocated_tensors():
    """With `allocate`, every stacked array is written into the tensor it returned (in a
    worker: the slot); the rest is collated as usual."""
    made = []

    def allocate(specs):
        made.append([torch.empty(shape, dtype=dtype) for shape, dtype in specs])
        return made[-1]

    samples = [{"img": np.full((2, 3), i, np.uint8), "x": torch.full((3,), i / 2), "label": i}
               for i in range(5)]
    batch = _assert_builds_like_collate(samples, allocate)
    assert [(tuple(t.shape), t.dtype) for t in made[0]] == [((5, 2, 3), torch.uint8), ((5, 3), torch.float32)]
    assert batch["img"] is made[0][0] and batch["x"] is made[0][1]
    # a batch that falls back leaves them unused: collate's own tensors come back
    samples[3]["img"] = np.zeros((2, 4), np.uint8)
    with pytest.raises(RuntimeError):
        _built(samples, allocate)
    del samples[3]["img"], samples[3]["x"]
    with pytest.raises(KeyError):
        _built(samples, allocate)


def test_batch_builder_of_plain_values_is_collate():
    for samples in ([1, 2, 3], [torch.ones(2), torch.zeros(2)], ["a", "b"], [np.ones(2), np.ones(2)]):
        _assert_builds_like_collate(samples)
