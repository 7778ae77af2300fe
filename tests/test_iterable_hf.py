"""`Loader` over a Hugging Face `datasets` IterableDataset streaming local files (JSON lines and
Parquet written here): DataLoader's batches, and exact resume through the dataset's own
`state_dict()`/`load_state_dict()`, per worker — also after a SIGKILL of the training process.

The resume tests run the loop users write (`for epoch in range(loader.epoch, epochs):
loader.set_epoch(epoch)`): the Loader's `set_epoch` calls the dataset's, whose saved state
holds its epoch (Hugging Face applies a state only within the epoch it was saved in).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

import shardloader
from shardloader.loader.iterable import IterableLoader
from tests import iterable_datasets as ids
from tests.iterable_kill import run_and_kill, run_to_end, steps
from tests.iterable_train import describe


def write_parquet(root: Path, files: int, rows: int) -> list[str]:
    paths = []
    for f in range(files):
        values = [100 * f + r for r in range(rows)]
        path = root / f"part-{f:02d}.parquet"
        pq.write_table(pa.table({"id": values, "text": [f"row {i}" for i in values],
                                 "vec": [[i / 3, -i / 5] for i in values]}), path)
        paths.append(str(path))
    return paths


@pytest.fixture(params=["json", "parquet"])
def files(request, tmp_path) -> tuple[str, list[str]]:
    """(the builder's name, 4 local files of 5 rows each)."""
    if request.param == "json":
        return "json", ids.write_jsonl(tmp_path, 4, 5)
    return "parquet", write_parquet(tmp_path, 4, 5)


def epoch_loop(loader: Any, epochs: int, stop_after: int | None = None) -> list[Any]:
    """The user's loop from the loader's epoch, each batch as plain values; `stop_after`:
    leave it after that many batches."""
    out: list[Any] = []
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            out.append(describe(batch))
            if len(out) == stop_after:
                return out
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_as_dataloader(files, num_workers):
    kind, paths = files
    kwargs = {"batch_size": 3, "num_workers": num_workers}
    expected = [describe(b) for b in DataLoader(ids.hf_stream(kind, paths), **kwargs)]
    with shardloader.Loader(ids.hf_stream(kind, paths), **kwargs) as loader:
        assert isinstance(loader, IterableLoader)
        assert [describe(b) for b in loader] == expected
    assert len(expected) == (8 if num_workers else 7)  # per worker: 2 files of 5 rows, 4 batches


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_through_the_datasets_state(files, num_workers):
    kind, paths = files

    def make() -> Any:
        return shardloader.Loader(ids.hf_stream(kind, paths), batch_size=3, num_workers=num_workers)

    with make() as loader:
        reference = epoch_loop(loader, 2)
    per_epoch = len(reference) // 2
    for stop_after in (1, 3, per_epoch, per_epoch + 2):
        with make() as loader:
            first = epoch_loop(loader, 2, stop_after)
            state = json.loads(json.dumps(loader.state_dict()))
        assert all(w["state"] is not None for w in state["iterable"]["workers"] if w["batches"])
        with make() as loader:
            loader.load_state_dict(state)
            rest = epoch_loop(loader, 2)
        assert first + rest == reference, f"stopped after {stop_after}"


def without_dataset_states(step: dict[str, Any]) -> dict[str, Any]:
    """A step file without the Hugging Face dataset's own states: their form is its own (after
    a restore, a position can be written another way); what they resume to is compared."""
    iterable = step["state"]["iterable"]
    workers = [{k: v for k, v in w.items() if k != "state"} for w in iterable["workers"]]
    return {**step, "state": {**step["state"], "iterable": {**iterable, "workers": workers}}}


def test_sigkill_mid_epoch_twice_then_resume_gives_the_uninterrupted_batches(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    ids.write_jsonl(data, 4, 5)
    run_to_end(tmp_path / "reference", f"hf:{data}", 2, epochs=2)
    reference = steps(tmp_path / "reference")
    assert len(reference) == 16
    killed = tmp_path / "killed"
    run_and_kill(killed, f"hf:{data}", 2, epochs=2, kill_after=3)  # mid-epoch 0
    assert len(steps(killed)) == 3
    run_and_kill(killed, f"hf:{data}", 2, epochs=2, kill_after=11)  # resumed, then mid-epoch 1
    assert len(steps(killed)) == 11
    run_to_end(killed, f"hf:{data}", 2, epochs=2)
    # Every batch's bytes, every epoch and every worker's position (and so the dataset states
    # saved after a resume resume again: the second kill resumed from one).
    assert [without_dataset_states(s) for s in steps(killed)] == [
        without_dataset_states(s) for s in reference]
