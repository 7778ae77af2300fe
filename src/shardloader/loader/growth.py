"""A map-style dataset whose length changes between epochs: each epoch takes `len(dataset)`
when it starts, as DataLoader's sampler does (`range(len(dataset))` at `iter()`).

The Loader's order, cursor and fingerprint are made for one length. An iteration that starts
an epoch from its beginning asks `follow_length`: if `len(dataset)` changed since, the plan
(for the Loader's own order or a PureSampler's), the cursor's epoch length and the
fingerprint's length follow it, and workers still running (persistent ones) are restarted,
since they hold the old plan and a copy of the dataset from before. During an epoch the
length may not change (`MapStyleDataset.check_length`: DatasetChangedError).

A state saved mid-epoch carries the length its epoch was made with (key "length"):
`resume_length` puts the Loader back on it, so that a resume onto a dataset that has grown
since (appended to) finishes that epoch exactly, and the next epoch takes the new length. A
dataset that shrank below the saved length cannot give the saved epoch's samples: StateError.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from shardloader.errors import StateError
from shardloader.loader.mapstyle import MapStyleDataset
from shardloader.loader.sampling import make_cursor

#: Kinds of order (see `shardloader.loader.sampling`) whose plan is made from the dataset's
#: length. The others take their positions from the user's sampler alone, as DataLoader does.
_FOLLOWS_LENGTH = ("own", "pure")


def follow_length(loader: Any, from_start: bool) -> tuple[Any, int, Callable[[], int]]:
    """An iteration of `loader` starts (from its epoch's start, or at a restored position):
    take the dataset's length now if the epoch starts, else check that the dataset still
    holds the epoch's samples. Returns the plan, its global steps and its `rank_batches`."""
    data = loader._data
    if isinstance(data, MapStyleDataset):
        length = data.begin_iteration()
        if from_start and length != len(data):
            use_length(loader, length)
        elif not from_start and length < len(data):
            raise StateError(_shrunk(data, len(data), length, "the epoch being resumed"))
    plan = loader._plan
    return plan, plan.global_steps, plan.rank_batches


def use_length(loader: Any, length: int) -> None:
    """Make `loader` read its map-style dataset as `length` samples from its next iteration."""
    data = loader._data
    data.use_length(length)
    kind = loader._order[0]
    if kind in _FOLLOWS_LENGTH:
        offsets = data.index.sample_offsets
        plan = dataclasses.replace(loader._plan, shard_sizes=np.diff(offsets), offsets=offsets,
                                   _cache={}, _blocks={}, _lock=threading.Lock())
        loader._plan = plan
        loader._workers.producer.plan = plan
        loader._cursor.length = make_cursor(kind, plan, loader.global_batch_size, loader.tail).length
    loader._workers.release(force=True)  # running workers hold the old plan and dataset copy


def saved_length(data: Any) -> int | None:
    """What a state keeps under "length": the current epoch's length of a map-style dataset."""
    return len(data) if isinstance(data, MapStyleDataset) else None


def resume_length(loader: Any, state: dict[str, Any]) -> None:
    """Before `loader` loads `state`: read its dataset at the length the state's epoch was made
    with (the fingerprint names it). StateError when the dataset now has fewer samples."""
    data, saved = loader._data, state.get("length")
    if not isinstance(data, MapStyleDataset) or saved is None or saved == len(data):
        return
    now = int(len(data.dataset))
    if now < saved:
        raise StateError(_shrunk(data, saved, now, "the saved epoch"))
    use_length(loader, saved)


def _shrunk(data: MapStyleDataset, saved: int, now: int, what: str) -> str:
    return (f"{data.name}: {what} was made with {saved} samples, and the dataset now has {now}: "
            f"it may grow between epochs or before a resume (the epoch finishes with its {saved} "
            f"samples, the next takes the new length), but not shrink below an epoch's length. "
            f"Restore the dataset's samples, or resume without this state")
