"""A dataset's own state in the Loader's state (issue 38 part 4), as StatefulDataLoader keeps
it: a map-style dataset with `state_dict()`/`load_state_dict()` (a counter, a curriculum stage)
is saved under the state's "dataset" key and restored by `Loader.load_state_dict()`.

Which copy's state. Worker processes each hold their own copy of the dataset. The Loader saves
the state of the copy that made the last delivered batch, as that batch left it (the producer
sends `state_dict()` back with each batch: `BatchTimings.dataset_state`), and restores it into
every worker it starts next (after `worker_init_fn`, before the first batch). So the state is
exact where one copy makes the batches in order: num_workers=0, or one worker process; with
several workers each copy only sees its own batches, as under DataLoader (StatefulDataLoader
keeps one state per worker instead; ours needs no fixed worker count to resume under).

When it is loaded, DataLoader's lifetimes kept: in the training process (num_workers=0, thread
workers: one shared copy) at once; for worker processes, into the workers started next — when
the restored position is inside an epoch, or always with persistent_workers (their copies live
on across epochs). Non-persistent workers start each epoch from the training process's copy,
as DataLoader's do, so a state saved at an epoch's end (or start) goes to no worker.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from shardloader.loader.cursor import Cursor
from shardloader.loader.pool_keeper import PoolKeeper
from shardloader.loader.protocol import LoaderDataset, stateful_part


def saved_dataset_state(data: LoaderDataset, cursor: Cursor) -> dict[str, Any] | None:
    """What the Loader's state keeps under "dataset": the state the last delivered batch left
    (or the one loaded last), else this process's copy's; None for a dataset without state."""
    holder = stateful_part(data)
    if holder is None:
        return None
    if cursor.dataset_state is not None:
        return copy.deepcopy(cursor.dataset_state)
    return copy.deepcopy(holder.state_dict())


def restore_dataset_state(data: LoaderDataset, cursor: Cursor, workers: PoolKeeper,
                          state: dict[str, Any] | None) -> None:
    """Restore a saved "dataset" entry where the next batches are made (module doc)."""
    holder = stateful_part(data)
    if state is None or holder is None:
        if state is not None:
            warnings.warn("the loader state holds a dataset state, but this Loader's dataset has no "
                          "load_state_dict(): the dataset's state is not restored", UserWarning,
                          stacklevel=3)
        return
    cursor.dataset_state = copy.deepcopy(state)
    if not workers.forks:  # one copy, in this process
        holder.load_state_dict(copy.deepcopy(state))
        return
    if workers.persistent or 0 < cursor.position < cursor.length:
        workers.release(force=True)  # running persistent workers would never load it
        workers.producer.dataset_state = copy.deepcopy(state)
