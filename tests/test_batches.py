"""Batch production: each sample's augmentation is exactly the one its key defines (I3),
whatever batch it shares and however cheaply the producer gets there."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shardloader import Dataset
from shardloader.ingest.writer import write_shards
from shardloader.loader.batches import BatchProducer, BatchTask, uses_global_rng
from shardloader.order.seeding import sample_generator, sample_key
from shardloader.synthetic import make_image_samples
from shardloader.transforms import Compose, DecodeCropFlip, Lambda, ToTensor
from tests.resume import assert_identical


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
        if isinstance(result, dict):
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
    assert_identical(batch, expected)
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


def _named_draw(sample, generator=None):
    """Asks for the generator by name."""
    return {"draw": torch.rand((), generator=generator)}


def _kwargs_draw(sample, **kwargs):
    """Takes keywords but never names `generator`: it must not be handed one."""
    assert not kwargs, f"handed {sorted(kwargs)}"
    return {"draw": torch.rand(())}


def test_the_loader_and_compose_hand_out_the_generator_by_one_rule(image_dataset):
    """One rule (`transforms.accepts_generator`) for the Loader's transform and for Compose's
    members: a callable that names `generator` receives the sample's generator alone and inside
    Compose and draws the same from it; one with a bare **kwargs receives it in neither (it
    draws from the global RNGs, seeded per sample from the same key: the same draws both ways)."""
    samples = np.array([5, 31, 12])

    def draws(transform):
        batch, _ = BatchProducer(image_dataset, seed=2, transform=transform)(BatchTask(1, 3, 0, samples))
        return batch["draw"]

    expected = torch.stack([torch.rand((), generator=sample_generator(sample_key(2, 3, s)))
                            for s in samples.tolist()])
    assert_identical(draws(_named_draw), expected)
    assert_identical(draws(Compose([_named_draw])), expected)
    assert_identical(draws(Compose([_kwargs_draw])), draws(_kwargs_draw))
    assert len(set(draws(_kwargs_draw).tolist())) == len(samples)  # seeded per sample


def test_producer_batch_does_not_depend_on_the_batch_it_shares(image_dataset):
    """Re-seeding one generator per batch gives each sample its own draws, wherever it sits."""
    producer = BatchProducer(image_dataset, seed=1, transform=DecodeCropFlip(16))
    alone, _ = producer(BatchTask(1, 0, 0, np.array([9])))
    among, _ = producer(BatchTask(2, 0, 0, np.array([4, 30, 9, 12])))
    assert torch.equal(alone["image"][0], among["image"][2])


@pytest.fixture(scope="module")
def mixed_image_dataset(tmp_path_factory):
    """JPEGs and a few PNGs (the fused transform's decode-then-crop branch), two fields."""
    import cv2

    out = tmp_path_factory.mktemp("batch-mixed")
    samples = []
    for i, s in enumerate(make_image_samples(30, min_size=24, max_size=64, seed=5)):
        image = s["image"]
        if i % 7 == 3:
            decoded = cv2.imdecode(np.frombuffer(image, np.uint8), cv2.IMREAD_COLOR)
            image = cv2.imencode(".png", decoded)[1].tobytes()
        samples.append({"jpg": image, "label": s["label"], "name": f"s{i}"})
    write_shards(iter(samples), str(out), shard_samples=11)
    return Dataset(str(out))


@pytest.mark.parametrize("transform", [
    DecodeCropFlip(16, field="jpg", out="jpg"),
    DecodeCropFlip(16, field="jpg", out="image"),  # a new field: it comes last, as in collate
    DecodeCropFlip((12, 20), field="jpg", out="jpg", p=1.0, antialias_method="k-area"),
    DecodeCropFlip(16, field="jpg", out="jpg", antialias=False, scale=(0.9, 1.0)),
    Compose([DecodeCropFlip((12, 20), field="jpg", out="x"), ToTensor(field="x")]),  # CHW
])
def test_direct_batch_path_equals_per_sample_transforms_and_default_collate(mixed_image_dataset,
                                                                            transform):
    producer = BatchProducer(mixed_image_dataset, seed=3, transform=transform)
    assert producer._direct is not None  # the direct path is the one under test
    samples = np.array([29, 3, 10, 17, 3, 0, 24, 10])  # PNGs at 3, 10, 17, 24; repeats
    batch, _ = producer(BatchTask(1, 2, 0, samples))
    expected = _reference_batch(mixed_image_dataset, transform, 3, 2, samples, False)
    assert list(batch) == list(expected)  # the same fields in the same order
    assert_identical(batch, expected)
    out = transform.out if isinstance(transform, DecodeCropFlip) else "x"
    assert batch[out].is_contiguous()


def test_direct_path_is_taken_only_where_it_gives_the_same_batch():
    from shardloader.loader.batches import direct_batch_transform
    from shardloader.loader.collate import collate

    class Subclass(DecodeCropFlip):
        def __call__(self, sample, generator=None):
            return super().__call__(sample, generator)

    fused = DecodeCropFlip(16)
    assert direct_batch_transform(fused, collate) == (fused, False)
    assert direct_batch_transform(Compose([fused, ToTensor()]), collate) == (fused, True)
    assert direct_batch_transform(fused, lambda records: collate(records)) is None
    assert direct_batch_transform(DecodeCropFlip(16, mode="L"), collate) is None
    assert direct_batch_transform(Subclass(16), collate) is None
    assert direct_batch_transform(Compose([fused, ToTensor(torch.float32)]), collate) is None
    assert direct_batch_transform(Compose([fused, ToTensor(field="other")]), collate) is None
    assert direct_batch_transform(Compose([ToTensor(), fused]), collate) is None
    assert direct_batch_transform(Compose([fused, ToTensor(), ToTensor()]), collate) is None


def test_direct_path_falls_back_for_records_with_different_fields(image_dataset):
    """Records whose fields differ go through the general path (and its collate's errors)."""
    producer = BatchProducer(image_dataset, seed=1, transform=DecodeCropFlip(16))
    records = image_dataset.get_many(np.array([1, 2]))
    del records[1]["label"]
    assert producer._direct_batch(BatchTask(1, 0, 0, np.array([1, 2])), records, np.array([1, 2])) is None


# -- the general path: any transform's batch collated straight into the worker's slot ---------


def _user_function(sample, generator=None):
    """A user's own function over the built-in transforms, with a field of its own."""
    image = ToTensor()(DecodeCropFlip(16, field="jpg")(sample, generator=generator))["image"]
    return {"img": image, "label": sample["label"], "mean": image.view(3, -1).float().mean(dim=1),
            "name": sample["name"]}


def _user_function_globals(sample, **kwargs):
    """Draws from the global RNGs (a bare **kwargs is handed no generator): seeded per sample
    by the producer. Returns a tuple: the batch is a list of columns."""
    image = DecodeCropFlip(16, field="jpg")(sample)["image"]
    return (torch.from_numpy(image).permute(2, 0, 1), sample["label"], np.random.rand(2))


def _resizing(sample, generator=None):
    """Output shape depends on the sample: batches mixing shapes fail as collate fails; a
    batch of one shape works."""
    size = 16 if sample["label"] % 2 else 12
    return {"img": DecodeCropFlip(size, field="jpg")(sample, generator=generator)["image"]}


def _writer_and_reader():
    import multiprocessing

    from shardloader.loader.workers.slots import SlotReader, SlotWriter

    returns = multiprocessing.get_context("fork").SimpleQueue()
    return SlotWriter(returns), SlotReader([returns])


@pytest.mark.parametrize("transform,seed_globals", [
    (_user_function, True),
    (_user_function_globals, True),
    (Compose([DecodeCropFlip((12, 20), field="jpg", out="x"), ToTensor(field="x")]), False),
])
@pytest.mark.parametrize("in_slot", [False, True])
def test_general_path_batches_are_the_reference_batches(mixed_image_dataset, transform,
                                                        seed_globals, in_slot):
    """Any transform: the batch collated sample by sample (in a worker, into its slot) is the
    per-sample transforms' default_collate, bit for bit, after its trip through the slot too."""
    producer = BatchProducer(mixed_image_dataset, seed=3, transform=transform)
    producer._direct = None  # the general path is the one under test (not the fused one)
    writer = reader = None
    if in_slot:
        writer, reader = _writer_and_reader()
        producer.allocate, producer.allocate_many = writer.allocate, writer.allocate_many
    samples = np.array([29, 3, 10, 17, 3, 0, 24, 10])
    for epoch in (2, 5):  # a second batch reuses the slot the first one gave back
        batch, _ = producer(BatchTask(1, epoch, 0, samples))
        if writer is not None:
            images = batch["img" if isinstance(batch, dict) and "img" in batch else "x"] \
                if isinstance(batch, dict) else batch[0]
            slot = writer._slots[writer._reserved[0]]  # the images were collated into the slot
            assert 0 <= images.data_ptr() - slot.data_ptr() < slot.numel()
            batch = reader.unpack(0, writer.pack(batch), wanted=True)
        expected = _reference_batch(mixed_image_dataset, transform, 3, epoch, samples, seed_globals)
        assert_identical(batch, expected)
        del batch
        if reader is not None:
            reader.give_back_freed()


def test_general_path_takes_changing_shapes_like_collate(mixed_image_dataset):
    writer, reader = _writer_and_reader()
    producer = BatchProducer(mixed_image_dataset, seed=1, transform=_resizing)
    producer.allocate, producer.allocate_many = writer.allocate, writer.allocate_many
    labels = np.array([mixed_image_dataset[i]["label"] for i in range(len(mixed_image_dataset))])
    odd, even = np.flatnonzero(labels % 2 == 1)[:3], np.flatnonzero(labels % 2 == 0)[:3]
    for samples in (odd, even, odd):  # each batch one shape, another than the batch before
        batch, _ = producer(BatchTask(1, 0, 0, samples))
        expected = _reference_batch(mixed_image_dataset, _resizing, 1, 0, samples, True)
        assert_identical(reader.unpack(0, writer.pack(batch), wanted=True), expected)
    mixed = np.concatenate([odd[:2], even[:1]])
    with pytest.raises(RuntimeError, match="equal size"):
        producer(BatchTask(2, 0, 0, mixed))
