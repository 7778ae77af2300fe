"""A map-style torch Dataset in the Loader: DataLoader's batches bit for bit, DataLoader's
defaults, and the Loader's guarantees (order and augmentation independent of workers, exact
O(1) resume, a fingerprint that refuses another dataset)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from shardloader import Loader
from shardloader.errors import StateError
from tests.resume import assert_exact_resume, assert_same_batches, record, take

N = 70  # 4 full batches of 16 and a short one of 6


class Pairs(Dataset):
    """(float32 tensor, int) tuples, a pure function of the index (DataLoader's output is then
    fixed too, so the two loaders can be compared byte for byte)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randn(3, 5, 5, generator=g), i % 10


class AugmentedPairs(Pairs):
    """Augments in __getitem__ with every global RNG, as torchvision-style datasets do."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image, label = super().__getitem__(i)
        noise = torch.rand(3, 5, 5) + float(np.random.rand()) + random.random()
        return image + noise, label


def test_batches_are_dataloaders_byte_for_byte():
    ds = Pairs()
    expected = [record(b, range(16 * k, min(16 * (k + 1), N)))
                for k, b in enumerate(DataLoader(ds, batch_size=16, num_workers=2))]
    loader = Loader(ds, batch_size=16, num_workers=2)
    got = []
    for batch in loader:
        assert type(batch) is list and len(batch) == 2  # DataLoader's shape: [images, labels]
        got.append(record(batch, loader.last_indices))
    assert_same_batches(got, expected, "Loader vs DataLoader")
    assert len(got) == 5 and got[-1].fields[1][2] == (6, 3, 5, 5)  # the short last batch
    loader.close()


def test_defaults_are_dataloaders_every_sample_once_with_a_short_last_batch():
    loader = Loader(Pairs())
    assert (loader.batch_size, loader.settings.shuffle, loader.persistent_workers) == (1, False, False)
    loader = Loader(Pairs(), batch_size=16)
    seen = []
    sizes = []
    for _images, labels in loader:
        seen.extend(loader.last_indices.tolist())
        sizes.append(len(labels))
    assert seen == list(range(N))  # in order: shuffle=False
    assert sizes == [16, 16, 16, 16, 6] and len(loader) == 5
    assert loader.tail_report() == {"padded": 0, "dropped": 0}


def test_workers_are_not_kept_between_epochs_by_default():
    loader = Loader(Pairs(), batch_size=16, num_workers=2)
    first = [record(b, loader.last_indices) for b in loader]
    assert loader._pool is None  # persistent_workers=False: released at the epoch's end
    again = [record(b, loader.last_indices) for b in loader]  # the next epoch, new workers
    assert again == first  # shuffle=False: every epoch is the same sequence
    loader.close()


def test_shuffled_epochs_hold_every_sample_once_and_differ():
    loader = Loader(AugmentedPairs(), batch_size=16, shuffle=True, seed=3)
    epochs = []
    for _ in range(2):
        order = []
        for _batch in loader:
            order.extend(loader.last_indices.tolist())
        epochs.append(order)
    for order in epochs:
        assert Counter(order) == Counter(range(N))
    assert epochs[0] != epochs[1] and epochs[0] != list(range(N))


@pytest.mark.parametrize("workers,kind", [(2, "process"), (3, "thread")])
def test_order_and_augmentation_do_not_depend_on_workers(workers, kind):
    reference = take(Loader(AugmentedPairs(), batch_size=16, shuffle=True, seed=3), 10)
    loader = Loader(AugmentedPairs(), batch_size=16, shuffle=True, seed=3, num_workers=workers,
                    worker_type=kind)
    assert take(loader, 10) == reference
    loader.close()


def test_augmentation_in_getitem_is_keyed_by_sample_not_by_position():
    shuffled = Loader(AugmentedPairs(), batch_size=16, shuffle=True, seed=3)
    in_order = Loader(AugmentedPairs(), batch_size=16, shuffle=False, seed=3)
    by_index = {}
    for images, _labels in shuffled:
        for i, image in zip(shuffled.last_indices.tolist(), images):
            by_index[i] = image.numpy().tobytes()
    for images, _labels in in_order:
        for i, image in zip(in_order.last_indices.tolist(), images):
            assert by_index[i] == image.numpy().tobytes()
    other_seed = take(Loader(AugmentedPairs(), batch_size=16, seed=4), 1)
    assert other_seed != take(Loader(AugmentedPairs(), batch_size=16, seed=3), 1)


class Draws(Pairs):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.rand(4), i


def _draw_again(sample: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, torch.Tensor]:
    return sample[0], torch.rand(4)


def test_getitem_draws_and_transform_draws_are_independent():
    """The dataset's draws and the Loader transform's draws of a sample use unrelated keys
    (the same key would make both draws equal: correlated augmentations)."""
    in_getitem, in_transform = next(iter(Loader(Draws(10), batch_size=10, transform=_draw_again)))
    assert not torch.isclose(in_getitem, in_transform).any()


@pytest.mark.parametrize("before,after", [(0, 2), (2, 0)])
def test_shuffled_resume_under_another_worker_count_is_exact(before, after):
    assert_exact_resume(
        lambda: Loader(AugmentedPairs(), batch_size=16, shuffle=True, seed=3, num_workers=before),
        12,
        [[2], [5], [4, 5, 11]],
        make_resumed=lambda _s: Loader(AugmentedPairs(), batch_size=16, shuffle=True, seed=3,
                                       num_workers=after),
    )


def test_fingerprint_names_the_class_and_length_and_refuses_another():
    loader = Loader(Pairs(), batch_size=16, shuffle=True)
    take(loader, 2)
    state = loader.state_dict()
    assert state["fingerprint"]["index"] == "tests.test_mapstyle.Pairs len=70"
    # a dataset grown since (append-only) finishes the saved epoch at 70 (tests/
    # test_dataloader_conformance.py: growth); one that shrank cannot
    with pytest.raises(StateError, match=r"made with 70 samples, and the dataset now has 69"):
        Loader(Pairs(69), batch_size=16, shuffle=True).load_state_dict(state)
    with pytest.raises(StateError, match="AugmentedPairs"):
        Loader(AugmentedPairs(), batch_size=16, shuffle=True).load_state_dict(state)


def test_a_datasets_own_fingerprint_is_part_of_the_state():
    class Versioned(Pairs):
        def __init__(self, version: str) -> None:
            super().__init__()
            self.fingerprint = version

    state = Loader(Versioned("v1"), batch_size=16).state_dict()
    assert state["fingerprint"]["index"].endswith("len=70 fingerprint=v1")
    with pytest.raises(StateError, match="fingerprint=v1.*fingerprint=v2"):
        Loader(Versioned("v2"), batch_size=16).load_state_dict(state)


def test_tail_under_two_ranks_gives_every_rank_the_same_steps_and_reports_the_padding():
    ranks = [Loader(Pairs(), batch_size=16, rank=r, world_size=2, shuffle=True) for r in range(2)]
    assert [r.tail for r in ranks] == ["pad", "pad"]  # DDP ranks must take equal steps
    assert [len(r) for r in ranks] == [3, 3]
    assert [r.tail_report() for r in ranks] == [{"padded": 26, "dropped": 0}] * 2
    seen = []
    for r in ranks:
        for images, _labels in r:
            assert images.shape[0] == 16
            seen.extend(r.last_indices.tolist())
    counts = Counter(seen)
    assert set(counts) == set(range(N)) and sum(counts.values()) == N + 26
    # Explicit alternatives: every sample once (ranks may differ by a step), or drop the tail.
    partial = [Loader(Pairs(), batch_size=16, rank=r, world_size=2, tail="partial") for r in range(2)]
    assert sorted(i for r in partial for _ in r for i in r.last_indices.tolist()) == list(range(N))
    dropped = Loader(Pairs(), batch_size=16, rank=0, world_size=2, drop_last=True)
    assert dropped.tail_report() == {"padded": 0, "dropped": 6} and len(dropped) == 2


_WORKER_ID = -1


def _remember_worker(worker_id: int) -> None:
    global _WORKER_ID
    _WORKER_ID = worker_id


class WhoReads(Pairs):
    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, _WORKER_ID


def test_worker_init_fn_runs_in_each_worker_process():
    loader = Loader(WhoReads(), batch_size=16, num_workers=2, worker_init_fn=_remember_worker)
    workers = [batch[1].tolist() for batch in loader]
    assert workers == [[k % 2] * len(w) for k, w in enumerate(workers)]  # tasks go round-robin
    assert [b[1].tolist() for b in Loader(WhoReads(), batch_size=16, worker_init_fn=_remember_worker)][0] == [-1] * 16
    with pytest.raises(ValueError, match="thread workers share this process"):
        Loader(WhoReads(), num_workers=2, worker_type="thread", worker_init_fn=_remember_worker)


@pytest.mark.parametrize("argument,advice", [
    ({"in_order": False}, "in order"),
    ({"sampler": [0, 1], "shuffle": True}, "pass shuffle=False"),
])
def test_unsupported_dataloader_arguments_say_what_to_use(argument, advice):
    with pytest.raises(ValueError, match=advice.replace("(", r"\(").replace(")", r"\)")):
        Loader(Pairs(), **argument)


def test_dataloader_argument_values_that_mean_the_default_are_accepted():
    loader = Loader(Pairs(), batch_size=16, shuffle=None, timeout=0, prefetch_factor=None,
                    pin_memory_device="", in_order=True, sampler=None)
    assert loader.settings.shuffle is False and loader.prefetch_factor is None and loader.timeout == 0


def test_not_map_style_is_a_clear_error():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with Loader(Stream()) as loader:  # an iterable dataset has a Loader of its own (test_iterable.py)
        assert type(loader).__name__ == "IterableLoader" and list(loader) == [0, 1, 2]
    with pytest.raises(TypeError, match="map-style.*iterable dataset.*got builtins.object"):
        Loader(object())

    class NoLength:
        def __getitem__(self, i):
            return i

    with pytest.raises(TypeError, match="NoLength has none"):
        Loader(NoLength())


def test_loader_dataset_is_the_users_dataset():
    ds = Pairs()
    assert Loader(ds).dataset is ds


def test_workers_forked_while_another_thread_reads_keyed_do_not_deadlock():
    """Another thread of this process (a second loader, a torchdata Prefetcher) may hold the
    global-RNG lock at the instant workers fork; the workers must not inherit it locked."""
    from shardloader.loader import batches

    with batches._GLOBAL_RNG_LOCK:  # as if another thread were inside a keyed read
        loader = Loader(AugmentedPairs(), batch_size=16, num_workers=2, timeout=20)
        got = take(loader, 5)  # a deadlocked worker is a WorkerError after the 20 s timeout
    loader.close()
    assert got == take(Loader(AugmentedPairs(), batch_size=16), 5)


class Deterministic(Pairs):
    uses_global_rng = False  # draws nothing: the Loader may skip seeding the RNGs per sample


def test_a_dataset_without_random_draws_is_read_without_seeding():
    from shardloader.loader.mapstyle import MapStyleDataset

    assert MapStyleDataset(Pairs()).keyed_reads and not MapStyleDataset(Deterministic()).keyed_reads
    assert take(Loader(Deterministic(), batch_size=16, num_workers=2), 5) == take(Loader(Pairs(), batch_size=16), 5)


class SometimesDraws(Pairs):
    """Draws from `random` for some samples and from `numpy.random` for others (and from
    neither for the rest), counting its calls: the lazily seeded reads must be those of
    seeding every generator before every sample."""

    def __init__(self, n: int = N) -> None:
        super().__init__(n)
        self.calls: Counter[int] = Counter()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.calls[i] += 1
        value = float(i)
        if i % 3 == 1:
            value += random.random()
        if i % 5 == 2:
            value += float(np.random.rand())
        return torch.tensor([value, float(torch.rand(()))], dtype=torch.float64), i


def _eager_reads(dataset, samples, epoch_keys):
    """`dataset[i]` under every global generator seeded from its read key (the eager scope)."""
    from shardloader.loader.mapstyle import _READ_KEY_BASE
    from shardloader.order.keys import derive_keys
    from shardloader.order.seeding import GlobalRngScope

    read_keys = derive_keys(_READ_KEY_BASE, np.asarray(epoch_keys, dtype=np.uint64)).tolist()
    out = []
    with GlobalRngScope() as scope:
        for sample, key in zip(samples, read_keys):
            scope.seed(key)
            out.append(dataset[sample][0])
    return out


def test_getitem_is_seeded_lazily_and_reads_what_eager_seeding_reads():
    import threading

    from shardloader.loader.mapstyle import MapStyleDataset
    from shardloader.order.seeding import sample_keys

    samples = np.arange(N)
    keys = sample_keys(3, 0, samples)
    expected = _eager_reads(SometimesDraws(), samples.tolist(), keys)
    dataset = SometimesDraws()
    got = MapStyleDataset(dataset).read_keyed(samples, keys, threading.Lock())
    assert [g[0].numpy().tobytes() for g in got] == [e.numpy().tobytes() for e in expected]
    # read again: only the first sample that drew from each generator (1 from random, 2 from numpy)
    assert {i for i, n in dataset.calls.items() if n != 1} == {1, 2} and dataset.calls[1] == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_lazily_seeded_getitem_gives_the_same_batches_for_any_worker_count(workers):
    reference = take(Loader(SometimesDraws(), batch_size=16, shuffle=True, seed=5), 10)
    loader = Loader(SometimesDraws(), batch_size=16, shuffle=True, seed=5, num_workers=workers)
    assert take(loader, 10) == reference
    loader.close()
