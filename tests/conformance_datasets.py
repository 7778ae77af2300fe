"""Datasets, collate functions and worker hooks for tests/test_dataloader_conformance.py.

They live in a module of their own, at module level, so that workers started by "spawn" or
"forkserver" can import them by module path (`tests.conformance_datasets`) and unpickle them,
as DataLoader's workers must. Every sample is a pure function of its index (tensors come from
a `torch.Generator` seeded by the index), so DataLoader's batches with `shuffle=False` are
fixed and the Loader's can be compared with them byte for byte.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, get_worker_info

Point = namedtuple("Point", ["x", "y"])


def _tensor(i: int, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7000 + i))


# -- samples of every shape default_collate knows ----------------------------------------------

def sample_tuple(i: int) -> tuple[Any, ...]:
    return (_tensor(i), torch.arange(4, dtype=torch.uint8) + i, i, i / 4)


def sample_dict(i: int) -> dict[str, Any]:
    return {"x": _tensor(i), "label": i, "name": f"s{i}", "half": _tensor(i, (3,)).half()}


def sample_namedtuple(i: int) -> Point:
    return Point(x=_tensor(i), y=i)


def sample_numpy(i: int) -> tuple[Any, ...]:
    return (np.arange(6, dtype=np.float32).reshape(2, 3) * i, np.int64(i), np.float64(i) / 3,
            np.array([i, -i], dtype=np.int16))


def sample_str(i: int) -> str:
    return f"sample-{i}"


def sample_bytes(i: int) -> bytes:
    return bytes([i % 256]) * 3


def sample_numbers(i: int) -> tuple[Any, ...]:
    return (i, i * 0.5, i % 2 == 0)


def sample_nested(i: int) -> list[Any]:
    return [[i, i + 1], [_tensor(i), {"k": i, "v": [float(i), -float(i)]}]]


def pil_transform(image: Image.Image) -> torch.Tensor:
    """A torchvision-free transform: resize, mirror, to a CHW float tensor in [0, 1]."""
    image = image.resize((4, 3), Image.BILINEAR).transpose(Image.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def sample_pil(i: int) -> tuple[torch.Tensor, int]:
    pixels = np.random.default_rng(i).integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    return pil_transform(Image.fromarray(pixels, "RGB")), i % 3


SAMPLES: dict[str, Callable[[int], Any]] = {
    "tuple": sample_tuple,
    "dict": sample_dict,
    "namedtuple": sample_namedtuple,
    "numpy": sample_numpy,
    "str": sample_str,
    "bytes": sample_bytes,
    "numbers": sample_numbers,
    "nested": sample_nested,
    "pil": sample_pil,
}


class Samples(Dataset):
    """`n` samples of one shape (a key of SAMPLES); index n and beyond raise IndexError."""

    def __init__(self, shape: str = "tuple", n: int = 10) -> None:
        self.shape = shape
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError("past the end")
        return SAMPLES[self.shape](i)


# -- collate functions -------------------------------------------------------------------------

def as_list(batch: list[Any]) -> list[Any]:
    """The samples themselves, uncollated."""
    return list(batch)


def collate_summary(batch: list[tuple[Any, ...]]) -> dict[str, Any]:
    """A custom collate of tuple samples: a dict that is not default_collate's shape."""
    return {"count": len(batch), "ids": [s[2] for s in batch], "x": torch.cat([s[0] for s in batch])}


def collate_nested(batch: list[tuple[Any, ...]]) -> list[Any]:
    """Nested tensors and lists, a non-contiguous view and a plain string: what a worker must
    send through shared memory and the main process must get back intact."""
    x = torch.stack([s[0] for s in batch])
    return [x, [torch.tensor([s[2] for s in batch]), (x[0].t(), "tag")],
            {"codes": torch.stack([s[1] for s in batch]), "names": [f"n{s[2]}" for s in batch]}]


# -- failing samples ---------------------------------------------------------------------------

class CorruptRecord(Exception):
    """A dataset's own exception class."""


class TwoArgError(Exception):
    """An exception whose __init__ takes two arguments but passes one message up: it cannot be
    rebuilt from its message alone (nor unpickled from its args)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} {why}")
        self.what, self.why = what, why


ERRORS: dict[str, type[BaseException]] = {
    "value": ValueError, "custom": CorruptRecord, "key": KeyError, "two_args": TwoArgError,
}


def _raise_corrupt(error: str) -> None:
    """The raise site every failing sample goes through (tracebacks must show it)."""
    if error == "two_args":
        raise TwoArgError("corrupt", "record")
    if error == "key":
        raise KeyError("missing-key")
    raise ERRORS[error]("corrupt record")


class Failing(Dataset):
    """Integers 0..n-1, except that sample `bad` raises the exception named `error` (ERRORS)."""

    def __init__(self, error: str, bad: int, n: int = 10) -> None:
        self.error, self.bad, self.n = error, bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            _raise_corrupt(self.error)
        return i


# -- a dataset whose length changes during an epoch --------------------------------------------

class Resizing(Dataset):
    """`n` samples until sample `at` is read, then `new_n` (read in the main process only: a
    worker's copy would change its own length)."""

    def __init__(self, n: int, at: int, new_n: int) -> None:
        self.n, self.at, self.new_n = n, at, new_n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i >= self.n:
            raise IndexError("past the end")
        if i == self.at:
            self.n = self.new_n
        return i


# -- worker info and worker_init_fn ------------------------------------------------------------

class WorkerInfoProbe(Dataset):
    """Each sample says what `get_worker_info()` returned while it was read: None in the main
    process, else (id, num_workers, seed, the dataset's class name, its `marker`, the pid,
    and what `mark_worker_copy` noted in this worker's copy, if it ran)."""

    def __init__(self, n: int = 8, marker: str = "probe-17") -> None:
        self.n, self.marker = n, marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, Any]:
        info = get_worker_info()
        if info is None:
            return i, None
        return i, (info.id, info.num_workers, info.seed, type(info.dataset).__name__,
                   getattr(info.dataset, "marker", None), os.getpid(),
                   getattr(info.dataset, "seeds_at_init", None))


def mark_worker_copy(worker_id: int) -> None:
    """A worker_init_fn that changes the worker's copy of a `WorkerInfoProbe`: its `marker`
    becomes "worker-<id>", and it notes (torch.initial_seed(), whether `random` was seeded
    with get_worker_info().seed), as DataLoader seeds both before worker_init_fn runs."""
    info = get_worker_info()
    info.dataset.marker = f"worker-{worker_id}"
    info.dataset.seeds_at_init = (torch.initial_seed(), random.random() == random.Random(info.seed).random())


def record_worker_init(directory: str, worker_id: int) -> None:
    """A worker_init_fn (bound to `directory` with functools.partial): one file per call, named
    by the worker id and the process id, holding what get_worker_info() said there."""
    info = get_worker_info()
    said = "none" if info is None else f"{info.id} {info.num_workers}"
    path = Path(directory) / f"{worker_id}-{os.getpid()}-{len(os.listdir(directory))}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(said)
    tmp.rename(path)  # a reader never sees a half-written file


# -- a dataset that grows between epochs --------------------------------------------------------

class Growing(Dataset):
    """`n` samples, each (i, i * i) as a tensor; `n` grows when the test appends
    (`grow(n)`). It reads any index, as a list read at a new length would: a worker whose copy
    of the dataset is older still reads the samples the epoch asks for."""

    def __init__(self, n: int) -> None:
        self.n = n

    def grow(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, i * i])


# -- a worker killed by a signal, a worker that never answers -----------------------------------

class KillsItself(Dataset):
    """Sample i is i, except that a worker reading sample `at` writes its pid to `pid_file` and
    SIGKILLs itself (in the main process it reads as any other: never kills the test)."""

    def __init__(self, n: int, at: int, pid_file: str) -> None:
        self.n, self.at, self.pid_file = n, at, pid_file

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.at and get_worker_info() is not None:
            Path(self.pid_file).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return i


class Blocks(Dataset):
    """Sample i is i, except that a worker reading sample `at` waits on an Event never set."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.at and get_worker_info() is not None:
            threading.Event().wait()
        return i
