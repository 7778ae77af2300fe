"""Iterable datasets for tests/test_iterable.py, test_iterable_hf.py and tests/iterable_train.py
(module level, so that spawned workers and the training subprocess can import them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _sample(i: int) -> dict[str, Any]:
    return {"i": i, "x": torch.tensor([i, i * i], dtype=torch.int64), "y": float(i) / 7}


class Split(IterableDataset):
    """Samples 0..n-1, each worker yielding those i with i % num_workers == its id."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        worker, workers = _worker()
        for i in range(worker, self.n, workers):
            yield _sample(i)


class SplitWithLen(Split):
    def __len__(self) -> int:
        return self.n


class NoSplit(IterableDataset):
    """Samples 0..n-1 in every worker: it ignores get_worker_info() (DataLoader then yields
    every sample once per worker)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield _sample(i)


class Range(IterableDataset):
    """torch's documented example: range(start, end), split by `split_range` (a worker_init_fn)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        for i in range(self.start, self.end):
            yield _sample(i)


def split_range(worker_id: int) -> None:
    """worker_init_fn: give this worker's copy of `Range` its share (torch's documentation)."""
    info = get_worker_info()
    dataset = info.dataset
    per_worker = -(-(dataset.end - dataset.start) // info.num_workers)
    dataset.start = dataset.start + worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, dataset.end)


class Uneven(IterableDataset):
    """Worker w yields `counts[w]` samples (num_workers=len(counts)): splits end at different
    turns, so workers drop out of the round robin one by one."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self):
        worker, _ = _worker()
        for j in range(self.counts[worker]):
            yield _sample(1000 * worker + j)


class WorkerInfoReport(IterableDataset):
    """Yields, in each worker, what get_worker_info() says there."""

    def __iter__(self):
        info = get_worker_info()
        yield {"id": info.id, "num_workers": info.num_workers, "seed_is_int": isinstance(info.seed, int),
               "dataset_is_self": info.dataset is self}


class Blocking(IterableDataset):
    """Never yields: its worker waits on a pipe nobody writes (for timeout=)."""

    def __iter__(self):
        import os

        read_end, _write_end = os.pipe()
        os.read(read_end, 1)
        yield _sample(0)


class Stateful(IterableDataset):
    """Split by worker; each sample has noise from the dataset's own generator (seeded per
    worker), so a batch's bytes depend on the generator's state. `state_dict()` is the next
    position in this worker's split and the generator's state; `load_state_dict` makes the
    next `iter()` continue there (torchdata's convention)."""

    def __init__(self, n: int, seed: int = 3) -> None:
        self.n, self.seed = n, seed
        self._state: dict[str, Any] = {}
        self._resume: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = state

    def __iter__(self):
        worker, workers = _worker()
        resume, self._resume = self._resume, None
        rng = np.random.default_rng([self.seed, worker])
        position = 0
        if resume:
            rng.bit_generator.state = resume["rng"]
            position = resume["next"]
        ids = list(range(worker, self.n, workers))
        while position < len(ids):
            sample = _sample(ids[position])
            sample["noise"] = torch.from_numpy(rng.random(3))
            position += 1
            self._state = {"next": position, "rng": rng.bit_generator.state}
            yield sample


def write_jsonl(root: Path, files: int, rows: int) -> list[str]:
    """`files` JSON-lines files of `rows` rows each: {"id", "text", "vec"}."""
    paths = []
    for f in range(files):
        path = root / f"part-{f:02d}.jsonl"
        with open(path, "w") as out:
            for r in range(rows):
                i = 100 * f + r
                out.write(json.dumps({"id": i, "text": f"row {i}", "vec": [i / 3, -i / 5]}) + "\n")
        paths.append(str(path))
    return paths


def hf_stream(kind: str, files: list[str]) -> Any:
    """A Hugging Face `datasets` IterableDataset streaming local `files` ("json" or "parquet")."""
    import datasets

    return datasets.load_dataset(kind, data_files=files, split="train", streaming=True)


class FailsAt(IterableDataset):
    """Split by worker; raises ValueError instead of yielding sample `bad`."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __iter__(self):
        worker, workers = _worker()
        for i in range(worker, self.n, workers):
            if i == self.bad:
                raise ValueError(f"sample {i} is bad")
            yield _sample(i)
