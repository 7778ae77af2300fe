"""The Loader: batches are a pure function of (dataset, seed, epoch) (I1, I3), resume is exact
and O(1) under any num_workers (I4), state is validated (I5), and failures are clear (I9)."""

from __future__ import annotations

import os
import random
import re
import signal
import warnings

import numpy as np
import pytest
import torch

from shardloader import Dataset, Loader
from shardloader.errors import StateError, WorkerError
from shardloader.ingest.writer import write_shards
from shardloader.order import ORDER_VERSION
from tests.resume import assert_exact_resume, record, take
from tests.sample_transforms import make_samples as _samples
from tests.sample_transforms import noisy_crop


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("loader-ds")
    write_shards(_samples(403), str(out), shard_samples=37)
    return str(out)


def make(dataset_dir, **kw):
    # The defaults these tests were written for (before DataLoader's became the defaults).
    args = dict(batch_size=8, seed=5, transform=noisy_crop, partitions=4, window=2,
                shuffle=True, tail="pad")
    args.update(kw)
    args.setdefault("persistent_workers", args.get("num_workers", 0) > 0)  # DataLoader: needs workers
    return Loader(Dataset(dataset_dir), **args)


def test_every_sample_once_per_epoch_and_epochs_differ(dataset_dir):
    loader = make(dataset_dir, tail="partial")
    first = [i for b in loader for i in b["__index__"].tolist()]
    second = [i for b in loader for i in b["__index__"].tolist()]
    assert sorted(first) == list(range(403)) and sorted(second) == list(range(403))
    assert first != second and loader.epoch == 2  # both epochs consumed: epoch 2 runs next
    assert len(loader) == 51


@pytest.mark.parametrize("workers,kind", [(2, "process"), (1, "process"), (3, "thread")])
def test_batches_do_not_depend_on_workers(dataset_dir, workers, kind):
    reference = take(make(dataset_dir), 20)
    loader = make(dataset_dir, num_workers=workers, worker_type=kind)
    assert take(loader, 20) == reference
    loader.close()


def test_augmentation_is_keyed_by_sample_not_by_position(dataset_dir):
    """The same sample gets the same augmented bytes wherever it lands in the epoch."""
    a = make(dataset_dir, seed=5)
    b = make(dataset_dir, seed=5, shuffle=False)
    by_index_a = {}
    for batch in a:
        for i, crop in zip(batch["__index__"].tolist(), batch["crop"]):
            by_index_a[i] = crop.numpy().tobytes()
    for batch in b:
        for i, crop in zip(batch["__index__"].tolist(), batch["crop"]):
            assert by_index_a[i] == crop.numpy().tobytes()


@pytest.mark.parametrize(
    "plan",
    [[0], [1], [25], [50], [51], [52], [60], [3, 7, 8, 40], [50, 51, 52]],
    ids=lambda p: "cuts-" + "-".join(map(str, p)),
)
def test_exact_resume_inline(dataset_dir, plan):
    assert_exact_resume(lambda: make(dataset_dir), 2 * 51 + 3, [plan])


@pytest.mark.parametrize("before,after", [(0, 2), (2, 0), (1, 3)])
def test_exact_resume_changing_num_workers(dataset_dir, before, after):
    assert_exact_resume(
        lambda: make(dataset_dir, num_workers=before),
        60,
        [[13], [51]],
        make_resumed=lambda _segment: make(dataset_dir, num_workers=after),
    )


def test_state_is_a_small_cursor(dataset_dir):
    loader = make(dataset_dir)
    take(loader, 3)
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["position"] == 24
    assert state["fingerprint"]["global_batch_size"] == 8
    assert state["fingerprint"]["index"] == loader.dataset.index.fingerprint


def test_resume_does_not_replay(dataset_dir):
    """Loading a state reads no data: the resumed loader reads only the batches it yields."""
    loader = make(dataset_dir)
    take(loader, 40)
    state = loader.state_dict()
    fresh = make(dataset_dir)
    fresh.load_state_dict(state)
    assert fresh.dataset._readers == {}  # nothing opened by load_state_dict
    batch = next(iter(fresh))
    expected = fresh.step_samples(0, 40)
    assert batch["__index__"].tolist() == expected.tolist()


def test_set_epoch_keeps_position_of_current_epoch(dataset_dir):
    loader = make(dataset_dir)
    take(loader, 5)
    loader.set_epoch(0)
    assert loader.state_dict()["position"] == 40
    loader.set_epoch(3)
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["position"] == 0
    assert next(iter(loader))["__index__"].tolist() == loader.step_samples(3, 0).tolist()


@pytest.mark.parametrize(
    "change,field",
    [({"seed": 6}, "seed"), ({"batch_size": 4}, "global_batch_size"), ({"shuffle": False}, "shuffle"),
     ({"window": 3}, "window"), ({"transform_version": "v2"}, "transform_version")],
)
def test_mismatched_fingerprint_is_rejected(dataset_dir, change, field):
    loader = make(dataset_dir)
    take(loader, 2)
    state = loader.state_dict()
    other = make(dataset_dir, **change)
    with pytest.raises(StateError, match=field):
        other.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(state, strict=False)
    assert any(field in str(w.message) for w in caught)


def test_state_of_another_order_version_is_refused(dataset_dir):
    """A change of the order algorithm changes the fingerprint: a state saved by a release with
    another order (order version 1 states carry no "order" field) is refused with a message
    naming both versions, never resumed into a different sequence."""
    loader = make(dataset_dir)
    take(loader, 2)
    state = loader.state_dict()
    assert state["fingerprint"]["order"] == ORDER_VERSION == 2
    old = {**state, "fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "order"}}
    with pytest.raises(StateError, match="saved with order version 1, this loader computes order version 2"):
        make(dataset_dir).load_state_dict(old)
    newer = {**state, "fingerprint": {**state["fingerprint"], "order": 3}}
    with pytest.raises(StateError, match="order version 3"):
        make(dataset_dir).load_state_dict(newer)
    resumed = make(dataset_dir)
    with pytest.warns(UserWarning, match="order version 1"):
        resumed.load_state_dict(old, strict=False)  # explicit override: same position, new order
    assert resumed.state_dict()["position"] == state["position"]


def test_dataset_changed_under_saved_state(tmp_path, dataset_dir):
    loader = make(dataset_dir)
    take(loader, 2)
    state = loader.state_dict()
    changed = tmp_path / "changed"
    samples = list(_samples(403))
    samples[100]["data"] = b"changed bytes"
    write_shards(samples, str(changed), shard_samples=37)
    with pytest.raises(StateError, match="index: saved"):
        make(str(changed)).load_state_dict(state)


def test_malformed_state_is_rejected(dataset_dir):
    loader = make(dataset_dir)
    state = loader.state_dict()
    with pytest.raises(StateError, match="position"):
        loader.load_state_dict({**state, "position": -1})
    with pytest.raises(StateError, match="step boundary"):
        loader.load_state_dict({**state, "position": 3})
    with pytest.raises(StateError, match="format"):
        loader.load_state_dict({"epoch": 0})


def test_iterating_never_draws_from_the_callers_global_rngs(dataset_dir):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    for workers in (0, 2):
        loader = make(dataset_dir, num_workers=workers)
        take(loader, 4)
        loader.close()
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_killed_worker_is_a_clear_error_not_a_hang(dataset_dir):
    loader = make(dataset_dir, num_workers=2, prefetch_factor=1)
    iterator = iter(loader)
    next(iterator)
    victim = loader._pool.pids()[0]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerError, match="SIGKILL"):
        for _ in range(len(loader)):
            next(iterator)
    # the iterator cannot go on, and says so (never a silent end of the epoch)
    with pytest.raises(RuntimeError, match="cannot go on: WorkerError"):
        next(iterator)
    # the loader recovers: a new iteration starts fresh workers at the epoch's start
    batch = next(iter(loader))
    assert batch["__index__"].tolist() == loader.step_samples(0, 0).tolist()
    loader.close()


class BadPixels(ValueError):
    """A dataset's own error type (the Loader must raise it, not a wrapper)."""


@pytest.mark.parametrize("workers,kind", [(0, "process"), (2, "process"), (2, "thread")])
def test_a_failing_sample_fails_its_batch_only(dataset_dir, workers, kind):
    """As with DataLoader: next() raises the transform's own exception type for the batch that
    needed the failing sample, naming the batch and the sample; that batch counts as consumed
    and the same iterator goes on with exactly the batches of a run without the failure."""
    reference = take(make(dataset_dir, tail="partial"), 51)
    bad = int(reference[3].indices[2])

    def picky(sample, generator):
        if sample["__index__"] == bad:
            raise BadPixels(f"bad pixels in sample {bad}")
        return noisy_crop(sample, generator=generator)

    loader = make(dataset_dir, tail="partial", transform=picky, transform_version="noisy",
                  num_workers=workers, worker_type=kind)
    iterator = iter(loader)
    got = [record(next(iterator)) for _ in range(3)]
    with pytest.raises(BadPixels, match=rf"bad pixels in sample {bad}") as raised:
        next(iterator)
    where = f"batch 3 of epoch 0, sample {bad}"
    shown = str(raised.value) + "".join(getattr(raised.value, "__notes__", []))
    assert where in shown
    first = str(raised.value).split("\n", 1)[0]  # what a log line or an alert shows: the cause
    assert first.startswith(f"bad pixels in sample {bad}")
    if workers and kind == "process":  # and where: the worker's traceback only below it
        assert re.fullmatch(rf"bad pixels in sample {bad} \(in shardloader worker process [01], {where}\)", first)
        assert "Original Traceback (most recent call last):" in str(raised.value)
    assert loader.state_dict()["position"] == 4 * 8  # the failed batch is consumed
    got += [record(batch) for batch in iterator]
    assert got == reference[:3] + reference[4:]
    assert loader.epoch == 1  # the epoch ended normally
    loader.close()


@pytest.mark.parametrize("tail,batches,last_size", [("pad", 51, 8), ("drop", 50, 8), ("partial", 51, 3)])
def test_tail_policies(dataset_dir, tail, batches, last_size):
    loader = make(dataset_dir, tail=tail)
    got = list(loader)
    assert len(got) == batches == len(loader)
    assert got[-1]["__index__"].numel() == last_size
    report = loader.tail_report()
    assert report == {"padded": 5 if tail == "pad" else 0, "dropped": 3 if tail == "drop" else 0}


def test_loader_is_a_dcp_stateful(dataset_dir):
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(make(dataset_dir), Stateful)


def test_record_detects_byte_differences(dataset_dir):
    """The resume helper itself must be able to fail: different augmentation seeds differ."""
    a = take(make(dataset_dir, seed=5), 3)
    b = take(make(dataset_dir, seed=6), 3)
    assert a != b
    batch = next(iter(make(dataset_dir)))
    assert record(batch) == record(dict(batch))


def test_thread_workers_never_close_a_reader_in_use(dataset_dir):
    """With one open shard allowed per process, threads reading different shards at once must
    not close each other's readers (a closed memory map would crash or return wrong bytes)."""
    class ReadersAtClose(Dataset):
        """Records how many readers are open when the Loader closes the dataset, which it does
        only after its worker threads were joined (so none is mid-read)."""

        open_at_close: int | None = None

        def close(self) -> None:
            self.open_at_close = len(self._readers)
            super().close()

    reference = take(make(dataset_dir), 30)
    dataset = ReadersAtClose(dataset_dir, max_open_shards=1)
    loader = Loader(dataset, batch_size=8, seed=5,
                    transform=noisy_crop, partitions=4, window=2, num_workers=3, worker_type="thread",
                    shuffle=True, tail="pad")
    assert take(loader, 30) == reference
    loader.close()
    # While threads read, up to one reader per thread may be open; once they are idle the
    # least recently used ones are closed down to the limit.
    assert dataset.open_at_close is not None and dataset.open_at_close <= 1


def test_a_changed_builtin_transform_is_refused_naming_it(dataset_dir):
    """No transform_version argument needed: the transform describes itself in the state."""
    from shardloader.transforms import Compose, DecodeCropFlip, ToTensor

    saved = Loader(Dataset(dataset_dir), batch_size=8, transform=DecodeCropFlip(64)).state_dict()
    assert saved["fingerprint"]["transform_version"].startswith("DecodeCropFlip(size=(64, 64)")
    Loader(Dataset(dataset_dir), batch_size=8, transform=DecodeCropFlip(64)).load_state_dict(saved)
    with pytest.raises(StateError, match=r"transform_version: saved .DecodeCropFlip\(size=\(64, 64\).*"
                                         r"now .DecodeCropFlip\(size=\(48, 48\)"):
        Loader(Dataset(dataset_dir), batch_size=8, transform=DecodeCropFlip(48)).load_state_dict(saved)
    composed = Loader(Dataset(dataset_dir), batch_size=8,
                      transform=Compose([DecodeCropFlip(64), ToTensor()])).state_dict()
    with pytest.raises(StateError, match=r"Compose\[DecodeCropFlip.*ToTensor.*now .Compose\[DecodeCropFlip"):
        Loader(Dataset(dataset_dir), batch_size=8,
               transform=Compose([DecodeCropFlip(64, p=0.0), ToTensor()])).load_state_dict(composed)


def test_plain_functions_contribute_their_name_and_an_explicit_version_overrides(dataset_dir):
    state = make(dataset_dir).state_dict()
    assert state["fingerprint"]["transform_version"] == "tests.sample_transforms.noisy_crop"
    with pytest.raises(StateError, match="transform_version: saved 'tests.sample_transforms.noisy_crop', now None"):
        make(dataset_dir, transform=None).load_state_dict(state)
    pinned = make(dataset_dir, transform_version="crop-v1").state_dict()
    assert pinned["fingerprint"]["transform_version"] == "crop-v1"
    make(dataset_dir, transform=lambda s: s, transform_version="crop-v1").load_state_dict(pinned)


def test_last_indices_are_the_batches_index_field(dataset_dir):
    loader = make(dataset_dir, num_workers=2)
    assert loader.last_indices is None
    for _, batch in zip(range(3), loader):
        assert loader.last_indices.tolist() == batch["__index__"].tolist()
    loader.close()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from shardloader.synthetic import make_image_samples

    out = tmp_path_factory.mktemp("loader-images")
    write_shards(({"image": s["image"], "label": s["label"]}
                  for s in make_image_samples(90, min_size=24, max_size=64, seed=2)),
                 str(out), shard_samples=20)
    return str(out)


def general_collate(records):
    """The default collate behind another function: the Loader then takes the general path
    (a dict and an array per sample, then collate) instead of the direct batch path."""
    from shardloader.loader.collate import collate

    return collate(records)


@pytest.mark.parametrize("workers,kind,chw", [(0, "process", False), (2, "process", False),
                                             (2, "thread", False), (2, "process", True)])
def test_direct_batch_path_gives_the_general_paths_batches(image_dir, workers, kind, chw):
    """DecodeCropFlip (alone or followed by ToTensor) with the default collate builds images
    straight into the batch (in a worker process: inside the shared-memory slot); the bytes
    are those of the per-sample transform and collate, for any num_workers and worker type,
    and across epochs."""
    from shardloader.transforms import Compose, DecodeCropFlip, ToTensor

    def loader(**kw):
        transform = Compose([DecodeCropFlip(20), ToTensor()]) if chw else DecodeCropFlip(20)
        return Loader(Dataset(image_dir), batch_size=16, seed=4, shuffle=True,
                      transform=transform, persistent_workers=kw.get("num_workers", 0) > 0, **kw)

    reference = loader(collate_fn=general_collate)
    expected = take(reference, 12)  # 6 batches per epoch: two epochs
    fast = loader(num_workers=workers, worker_type=kind)
    assert take(fast, 12) == expected
    fast.close()
    reference.close()


def test_a_state_saved_with_the_k_area_antialias_resumes_only_into_it(image_dir):
    """The 'adaptive' antialias method (the default) changes pixels: a state saved with the
    earlier method ('k-area', whose version string is unchanged) is refused by a loader with
    the new default, naming it, and resumes exactly into 'k-area'."""
    from shardloader.transforms import DecodeCropFlip

    def loader(**kw):
        return Loader(Dataset(image_dir), batch_size=16, seed=4, shuffle=True,
                      transform=DecodeCropFlip(20, **kw))

    old = loader(antialias_method="k-area")
    take(old, 2)
    state = old.state_dict()
    assert "antialias_method" not in state["fingerprint"]["transform_version"]
    with pytest.raises(StateError, match=r"transform_version: saved .*max_upscale=1.0\)#impl1., "
                                         r"now .*antialias_method='adaptive'\)#impl1."):
        loader().load_state_dict(state)
    resumed = loader(antialias_method="k-area")
    resumed.load_state_dict(state)
    assert take(resumed, 3) == take(loader(antialias_method="k-area"), 5)[2:]


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_len_is_what_a_pass_yields_on_every_rank_with_a_partial_tail(rank):
    """19 samples, 3 ranks of batch 2 (global 6): the last global batch has 1 sample, so ranks 1
    and 2 get none of it and one batch less. len(), the batch sampler and a pass agree on each rank;
    the ranks' samples together are the epoch, each once."""
    loader = Loader(list(range(19)), batch_size=2, rank=rank, world_size=3, tail="partial")
    batches = [batch.tolist() for batch in loader]
    assert len(loader) == len(batches) == len(loader.batch_sampler) == (4 if rank == 0 else 3)
    assert list(loader.batch_sampler) == batches
    assert len(iter(loader)) == len(loader)  # an iterator's length too, as DataLoader's
    everyone = sorted(sum((sum([b.tolist() for b in Loader(list(range(19)), batch_size=2, rank=r,
                                                           world_size=3, tail="partial")], [])
                           for r in range(3)), []))
    assert everyone == list(range(19))  # a set check: which rank reads what is the order's business


@pytest.mark.parametrize("argument,value,error,named", [
    ("num_workers", 1.5, TypeError, "num_workers must be an integer"),
    ("num_workers", "2", TypeError, "num_workers must be an integer"),
    ("prefetch_factor", "2", TypeError, "prefetch_factor must be an integer"),
    ("prefetch_factor", 2.0, TypeError, "prefetch_factor must be an integer"),
    ("timeout", "5", TypeError, "timeout must be a number"),
    ("seed", 1.7, TypeError, "seed must be an integer"),
    ("seed", "1", TypeError, "seed must be an integer"),
])
def test_arguments_of_the_wrong_type_are_refused_naming_them(argument, value, error, named):
    kwargs = {"num_workers": 2} if argument == "prefetch_factor" else {}
    with pytest.raises(error, match=named):
        Loader(list(range(8)), batch_size=2, **{**kwargs, argument: value})


def test_drop_last_with_a_batch_larger_than_the_dataset_warns_once():
    with pytest.warns(UserWarning, match=r"drop_last=True with 5 samples and a global batch of 8: "
                                         r"every epoch has no batch"):
        loader = Loader(list(range(5)), batch_size=8, drop_last=True)
    assert len(loader) == 0 and list(loader) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_returning_none_is_named_with_the_sample(dataset_dir, workers):
    def forgetful(sample):
        sample["crop"] = sample["data"][:4]  # forgot the `return sample`

    loader = make(dataset_dir, transform=forgetful, transform_version="forgetful", num_workers=workers)
    first = int(loader.step_samples(0, 0)[0])
    with pytest.raises(TypeError, match=rf"(?s)transform .*forgetful.* returned None for sample {first}"):
        next(iter(loader))
    loader.close()


def test_a_timeout_is_reported_within_about_its_bound(dataset_dir):
    """timeout=0.5 with a batch that never comes: the error arrives soon after 0.5 s, not after
    the workers' shutdown (they are terminated, not waited for)."""
    import threading
    import time

    def stuck(sample):
        threading.Event().wait()

    from shardloader.loader.workers.pool import CLOSE_SECONDS

    loader = make(dataset_dir, transform=stuck, transform_version="stuck", num_workers=2, timeout=0.5)
    loader._workers.get()  # the workers start now, not inside the timed call
    started = time.monotonic()
    with pytest.raises(WorkerError, match="timed out after 0.5 seconds"):
        next(iter(loader))
    # 0.5 s, then ~0.5 s for the stuck workers before they are terminated; it used to wait the
    # whole CLOSE_SECONDS for them first (5.6 s in all)
    assert time.monotonic() - started < CLOSE_SECONDS
    loader.close()
