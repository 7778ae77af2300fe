"""Batch production: the fast collate gives default_collate's batches, and each sample's
augmentation is exactly the one its key defines (I3), however cheaply the producer gets there."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shardloader import Dataset
from shardloader.format.writer import write_shards
from shardloader.loader.batches import BatchProducer, BatchTask, collate, uses_global_rng
from shardloader.order.seeding import sample_generator, sample_key
from shardloader.synthetic import make_image_samples
from shardloader.transforms import Compose, DecodeCropFlip, Lambda, ToTensor


def assert_same(a, b, where="batch"):
    """Equal structure, types, dtypes, shapes and bytes."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


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
        assert_same(collate(records), expected)


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


def test_builtin_transforms_declare_they_need_no_global_seeding():
    def plain(sample):
        return sample

    assert not uses_global_rng(DecodeCropFlip(8))
    assert not uses_global_rng(Compose([DecodeCropFlip(8), ToTensor()]))
    assert uses_global_rng(Compose([DecodeCropFlip(8), plain]))
    assert uses_global_rng(Lambda(plain))
    assert uses_global_rng(plain)


@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch-images")
    samples = ({"image": s["image"], "label": s["label"]}
               for s in make_image_samples(40, min_size=24, max_size=48, seed=3))
    write_shards(samples, str(out), shard_samples=15)
    return Dataset(str(out))


def _global_and_generator_crop(sample, generator):
    """Draws from its generator and from every global RNG."""
    image = DecodeCropFlip(16)(sample, generator=generator)["image"].astype(np.int16)
    noise = (random.randint(0, 3) + int(np.random.randint(0, 3))
             + int(torch.randint(0, 3, (1,)).item()))
    return {"image": image + noise, "label": sample["label"]}


def _reference_batch(ds, transform, seed, epoch, samples, seed_globals):
    """What the Loader's contract (I3) says a batch is, written out the slow, obvious way: a
    fresh generator per sample from its key and, when asked, the global RNGs seeded with
    random.seed / np.random.seed / torch.manual_seed from the same key."""
    out = []
    for s in samples.tolist():
        key = sample_key(seed, epoch, s)
        if seed_globals:
            random.seed(key)
            np.random.seed([key & 0xFFFF_FFFF, key >> 32])
            torch.manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
        result = transform(ds[s], generator=sample_generator(key))
        result.setdefault("__index__", s)
        out.append(result)
    return default_collate(out)


@pytest.mark.parametrize("transform,seed_globals", [
    (DecodeCropFlip(16), False),
    (_global_and_generator_crop, True),
])
def test_producer_batches_are_the_keyed_per_sample_augmentations(image_dataset, transform,
                                                                  seed_globals):
    producer = BatchProducer(image_dataset, seed=11, transform=transform)
    samples = np.array([33, 2, 17, 2, 39, 0, 21])  # across shards, one repeated
    batch, _ = producer(BatchTask(1, 4, 0, samples))
    expected = _reference_batch(image_dataset, transform, 11, 4, samples, seed_globals)
    assert_same(batch, expected)
    # and the process's own global streams are where they were
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    before = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    producer(BatchTask(2, 4, 1, samples))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == before


def test_producer_batch_does_not_depend_on_the_batch_it_shares(image_dataset):
    """Re-seeding one generator per batch gives each sample its own draws, wherever it sits."""
    producer = BatchProducer(image_dataset, seed=1, transform=DecodeCropFlip(16))
    alone, _ = producer(BatchTask(1, 0, 0, np.array([9])))
    among, _ = producer(BatchTask(2, 0, 0, np.array([4, 30, 9, 12])))
    assert torch.equal(alone["image"][0], among["image"][2])
