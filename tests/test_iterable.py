"""`Loader(iterable_dataset)`: DataLoader's batches for iterable datasets, and a resume that is
exact (a dataset with state), by fast-forward (one without), or refused (a one-shot iterator).

DataLoader's batches are the expected values, compared whole and bit for bit
(`tests.resume.assert_identical`). Resumed runs are compared with uninterrupted ones as the
recorded bytes of every batch (`tests.resume.record`); the kill tests SIGKILL a training
subprocess with real worker processes mid-epoch (tests/iterable_train.py).
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch.utils.data import DataLoader

import shardloader
from shardloader.errors import StateError, WorkerError
from shardloader.loader.iterable import IterableLoader
from tests import iterable_datasets as ids
from tests.iterable_kill import run_and_kill, run_to_end, steps
from tests.resume import RecordedBatch, assert_identical, assert_same_batches, record


def dataloader_batches(dataset: Any, **kwargs: Any) -> list[Any]:
    return list(DataLoader(dataset, **kwargs))


def loader_batches(dataset: Any, **kwargs: Any) -> list[Any]:
    with shardloader.Loader(dataset, **kwargs) as loader:
        assert isinstance(loader, IterableLoader)
        return list(loader)


def stream(loader: Any) -> Iterator[RecordedBatch]:
    """The loader's batches, recorded, passing from one epoch to the next (`tests.resume.stream`
    for batches without sample indices). One pass may be empty: the first after loading a
    state saved on an epoch's last batch; two in a row end the stream."""
    empty = 0
    while empty < 2:
        received = 0
        for batch in loader:
            received += 1
            yield record(batch, indices=())
        empty = 0 if received else empty + 1


def take(loader: Any, count: int) -> list[RecordedBatch]:
    return list(itertools.islice(stream(loader), count))


def resumed(make: Callable[[], Any], total: int, cuts: list[int]) -> list[RecordedBatch]:
    """`total` batches taken in segments: at each cut the state goes through JSON into a
    fresh loader, which continues."""
    loader, got, done = make(), [], 0
    for cut in [*cuts, total]:
        got += take(loader, cut - done)
        done = cut
        if cut == total:
            break
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        loader = make()
        loader.load_state_dict(state)
    loader.close()
    return got


# -- DataLoader's batches ------------------------------------------------------------------------

CASES = [(bs, dl) for bs in (None, 3) for dl in (False, True) if not (bs is None and dl)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("batch_size", "drop_last"), CASES)
@pytest.mark.parametrize("dataset", ["split", "nosplit"])
def test_same_batches_as_dataloader(dataset, num_workers, batch_size, drop_last):
    ds = ids.Split(13) if dataset == "split" else ids.NoSplit(7)
    kwargs = {"batch_size": batch_size, "drop_last": drop_last, "num_workers": num_workers}
    assert_identical(loader_batches(ds, **kwargs), dataloader_batches(ds, **kwargs))


def test_spawned_workers_give_the_same_batches():
    kwargs = {"batch_size": 2, "num_workers": 2}
    assert_identical(loader_batches(ids.Split(9), multiprocessing_context="spawn", **kwargs),
                     dataloader_batches(ids.Split(9), **kwargs))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_sample_raises_its_own_error_where_dataloaders_does(num_workers):
    def outcomes(loader: Any, ours: bool) -> list[Any]:
        out, iterator = [], iter(loader)
        while True:
            try:
                out.append(next(iterator)["i"].tolist())
            except StopIteration:
                return out
            except ValueError as e:
                if ours:  # the cause on the first line (DataLoader's names its worker first)
                    assert str(e).startswith("sample 5 is bad")
                out.append("ValueError")

    kwargs = {"batch_size": 2, "num_workers": num_workers}
    expected = outcomes(DataLoader(ids.FailsAt(12, 5), **kwargs), ours=False)
    with shardloader.Loader(ids.FailsAt(12, 5), **kwargs) as loader:
        assert outcomes(loader, ours=True) == expected
    assert "ValueError" in expected


def test_worker_init_fn_splits_the_range_as_dataloaders_does():
    kwargs = {"batch_size": 2, "num_workers": 2, "worker_init_fn": ids.split_range}
    expected = dataloader_batches(ids.Range(3, 14), **kwargs)
    assert_identical(loader_batches(ids.Range(3, 14), **kwargs), expected)
    # Without it, each worker yields the whole range: the function's effect is what splits it.
    assert len(loader_batches(ids.Range(3, 14), batch_size=2, num_workers=2)) == 2 * len(expected)


@pytest.mark.filterwarnings("ignore:.*worker processes")  # 3 workers on a 2-core machine
def test_workers_whose_split_ends_drop_out_in_dataloaders_order():
    ds = ids.Uneven([1, 7, 4])
    kwargs = {"batch_size": 2, "num_workers": 3, "prefetch_factor": 3}
    got = loader_batches(ds, **kwargs)
    assert_identical(got, dataloader_batches(ds, **kwargs))
    assert [b["i"][0].item() // 1000 for b in got] == [0, 1, 2, 1, 2, 1, 1]


def test_persistent_workers_and_two_passes():
    ds = ids.Split(11)
    kwargs = {"batch_size": 3, "num_workers": 2, "persistent_workers": True}
    reference = DataLoader(ds, **kwargs)
    expected = [list(reference), list(reference)]
    with shardloader.Loader(ds, **kwargs) as loader:
        next(iter(loader))  # a peek: the next pass starts over, its workers' iterators too
        pool = loader._pool
        first = list(loader)
        assert_identical([first, list(loader)], expected)
        assert loader._pool is pool and loader.epoch == 2


def test_get_worker_info_in_a_worker_is_dataloaders():
    kwargs = {"batch_size": None, "num_workers": 2}
    assert_identical(loader_batches(ids.WorkerInfoReport(), **kwargs),
                     dataloader_batches(ids.WorkerInfoReport(), **kwargs))


def test_len_is_dataloaders():
    for kwargs in ({"batch_size": 3}, {"batch_size": 3, "drop_last": True}, {"batch_size": None}):
        with shardloader.Loader(ids.SplitWithLen(10), **kwargs) as loader:
            assert len(loader) == len(DataLoader(ids.SplitWithLen(10), **kwargs))
    with shardloader.Loader(ids.Split(10)) as loader, pytest.raises(TypeError):
        len(loader)


@pytest.mark.parametrize("kwargs", [{"shuffle": True}, {"sampler": [0, 1]},
                                    {"batch_size": None, "drop_last": True}])
def test_refusals_are_dataloaders(kwargs):
    with pytest.raises(ValueError) as expected:
        DataLoader(ids.Split(4), **kwargs)
    with pytest.raises(ValueError) as got:
        shardloader.Loader(ids.Split(4), **kwargs)
    assert str(got.value) == str(expected.value)


def test_timeout_on_a_worker_that_never_answers():
    with shardloader.Loader(ids.Blocking(), num_workers=1, timeout=1) as loader:
        with pytest.raises(WorkerError, match="timed out after 1 seconds"):
            next(iter(loader))


# -- resume --------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_of_a_dataset_with_state(num_workers):
    def make():
        return shardloader.Loader(ids.Stateful(20), batch_size=3, num_workers=num_workers)

    per_epoch = 8 if num_workers else 7
    with make() as loader:
        reference = take(loader, 2 * per_epoch)
    for cuts in ([1], [5], [per_epoch - 1, per_epoch], [3, 4, per_epoch + 2]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a dataset with state resumes without a warning
            got = resumed(make, 2 * per_epoch, cuts)
        assert_same_batches(got, reference, f"cuts {cuts}")


def test_a_torchdata_pipeline_around_it_resumes_exactly():
    import torchdata.nodes as tn

    loaders = []

    def pipeline() -> tn.Loader:
        loaders.append(shardloader.Loader(ids.Stateful(20), batch_size=3, num_workers=2))
        return tn.Loader(shardloader.LoaderNode(loaders[-1]))

    reference = [record(b, indices=()) for b in pipeline()]
    first = iter(pipeline())
    got = [record(next(first), indices=()) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    second = pipeline()
    second.load_state_dict(state)
    got += [record(b, indices=()) for b in second]
    for loader in loaders:
        loader.close()
    assert len(reference) == 8
    assert_same_batches(got, reference, "torchdata pipeline")


def test_resume_by_fast_forward_warns_with_the_cost_and_is_exact():
    def make():
        return shardloader.Loader(ids.Split(23), batch_size=3, num_workers=2)

    with make() as loader:
        reference = take(loader, 8)
    with make() as loader:
        first = take(loader, 5)
        state = json.loads(json.dumps(loader.state_dict()))
    assert [w["batches"] for w in state["iterable"]["workers"]] == [3, 2]
    with make() as loader:
        with pytest.warns(UserWarning, match=r"fast-forward.* the 5 batches delivered before "
                                             r"\(worker 0: 3, worker 1: 2\): O\(position\)"):
            loader.load_state_dict(state)
        rest = take(loader, 3)
    assert_same_batches(first + rest, reference, "fast-forward")


def test_a_one_shot_iterator_refuses_a_state_mid_epoch():
    with shardloader.Loader((ids._sample(i) for i in range(7)), batch_size=2) as loader:
        assert loader.state_dict()["iterable"]["workers"][0]["batches"] == 0
        iterator = iter(loader)
        next(iterator)
        with pytest.raises(StateError, match="one-shot iterator"):
            loader.state_dict()
        assert len(list(iterator)) == 3
        assert loader.state_dict()["epoch"] == 1  # an epoch's end is a state again


def test_a_state_is_refused_by_another_worker_count():
    with shardloader.Loader(ids.Stateful(20), batch_size=3, num_workers=2) as loader:
        take(loader, 3)
        state = loader.state_dict()
    with shardloader.Loader(ids.Stateful(20), batch_size=3, num_workers=1) as other:
        with pytest.raises(StateError, match="saved with num_workers=2.*Resume with num_workers=2"):
            other.load_state_dict(state)
    with shardloader.Loader(ids.Stateful(20), batch_size=4, num_workers=2) as other:
        with pytest.raises(StateError, match="global_batch_size: saved 3, now 4"):
            other.load_state_dict(state)


@pytest.mark.parametrize(("where", "value", "message"), [
    ("workers", [], "'iterable.workers' must be a non-empty list"),
    ("next_worker", 2, "'iterable.next_worker' must be a worker id below 2, got 2"),
    ("batches", -1, r"'iterable.workers\[1\]'.batches must be a non-negative integer"),
    ("ended", "no", r"'iterable.workers\[1\]'.ended must be true or false"),
    ("state", [1], r"'iterable.workers\[1\]'.state must be the dataset's state_dict\(\)"),
    ("steps_before", -1, "'iterable.steps_before' must be a non-negative integer, got -1"),
])
def test_a_damaged_state_is_refused_naming_the_field(where, value, message):
    with shardloader.Loader(ids.Stateful(20), batch_size=3, num_workers=2) as loader:
        take(loader, 3)
        state = json.loads(json.dumps(loader.state_dict()))
        section = state["iterable"]
        if where in ("workers", "next_worker", "steps_before"):
            section[where] = value
        else:
            section["workers"][1][where] = value
        with pytest.raises(StateError, match=message):
            loader.load_state_dict(state)
        del state["iterable"]
        with pytest.raises(StateError, match="no 'iterable' section: it was saved by a Loader of a map-style"):
            loader.load_state_dict(state)


class _Capture:
    """A telemetry sink that keeps the records it gets."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def on_batch(self, record: Any) -> None:
        self.records.append(record)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_telemetry_records_every_batch_with_a_step_counted_across_epochs_and_a_resume(num_workers):
    """A record per delivered batch, as for a map-style dataset: the step counts batches since
    epoch 0 (an epoch's length is known only at its end), and goes on after a resume; the
    samples are the batch's; the worker's time in the dataset's iterator is its read_seconds."""
    per_epoch = 8 if num_workers else 7

    def make(sink: _Capture) -> Any:
        return shardloader.Loader(ids.Stateful(20), batch_size=3, num_workers=num_workers,
                                  telemetry=sink)

    sink = _Capture()
    with make(sink) as loader:
        batches = take(loader, 2 * per_epoch)
        summary = loader.stats()
        assert loader.step == 2 * per_epoch
    sizes = [batch.fields[0][2][0] for batch in batches]
    assert [r.step for r in sink.records] == list(range(1, 2 * per_epoch + 1))
    assert [r.epoch for r in sink.records] == [0] * per_epoch + [1] * per_epoch
    assert [r.samples for r in sink.records] == sizes and sum(sizes) == 40
    assert all(r.read_seconds > 0 and r.transform_seconds > 0 and r.fetch_seconds > 0
               and r.bytes_downloaded == 0 for r in sink.records)
    assert summary["batches"] == 2 * per_epoch and summary["samples"] == 40

    cut = per_epoch + 2  # into the second epoch
    first, rest = _Capture(), _Capture()
    with make(first) as loader:
        take(loader, cut)
        state = json.loads(json.dumps(loader.state_dict()))
    with make(rest) as loader:
        loader.load_state_dict(state)
        assert loader.step == cut
        take(loader, 2 * per_epoch - cut)
    assert [r.step for r in first.records + rest.records] == list(range(1, 2 * per_epoch + 1))
    assert [r.epoch for r in rest.records] == [1] * (2 * per_epoch - cut)


@pytest.mark.parametrize(("num_workers", "kill_after"), [(2, 5), (0, 4)])
def test_sigkill_mid_epoch_then_resume_gives_the_uninterrupted_batches(tmp_path, num_workers, kill_after):
    run_to_end(tmp_path / "reference", "stateful", num_workers, epochs=2)
    reference = steps(tmp_path / "reference")
    assert len(reference) == (16 if num_workers else 14)
    run_and_kill(tmp_path / "killed", "stateful", num_workers, epochs=2, kill_after=kill_after)
    assert len(steps(tmp_path / "killed")) == kill_after  # killed inside the first epoch
    run_to_end(tmp_path / "killed", "stateful", num_workers, epochs=2)
    assert steps(tmp_path / "killed") == reference  # every batch's bytes and every state
