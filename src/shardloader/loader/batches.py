"""Producing one batch: read rows, transform each sample under its key, collate.

This is what a worker does for each task. It depends only on the task (epoch, sample
indices), the dataset and the transform — never on which worker runs it or on any RNG stream —
so the batches are the same for every `num_workers` and world size (I1, I3).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from shardloader.order.seeding import GlobalRngScope, sample_generator, sample_key

Transform = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class BatchTask:
    """One batch to produce: `samples` are global sample indices in output order."""

    task_id: int
    epoch: int
    step: int
    samples: np.ndarray
    padded: int = 0


@dataclass
class BatchTimings:
    """Where a worker spent its time on one batch (seconds), plus cache counters."""

    read_seconds: float = 0.0
    transform_seconds: float = 0.0
    download_wait_seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    bytes_downloaded: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def accepts_generator(transform: Transform | None) -> bool:
    """True when `transform` takes a `generator` keyword (or **kwargs)."""
    if transform is None:
        return False
    try:
        params = inspect.signature(transform).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.name == "generator" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params
    )


def uses_global_rng(transform: Transform | None) -> bool:
    """Whether global RNGs must be seeded per sample: yes unless the transform says otherwise."""
    if transform is None:
        return False
    return bool(getattr(transform, "uses_global_rng", True))


class BatchProducer:
    """Turns a BatchTask into a collated batch. Picklable: it travels into worker processes."""

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int,
        transform: Transform | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self.transform = transform
        self.collate_fn = collate_fn or default_collate
        self._pass_generator = accepts_generator(transform)
        self._seed_globals = uses_global_rng(transform)

    def __call__(self, task: BatchTask) -> tuple[Any, BatchTimings]:
        timings = BatchTimings()
        counters = getattr(self.dataset.source, "counters", None)
        before = counters() if counters else None
        t0 = time.perf_counter()
        records = self.dataset.get_many(task.samples)
        t1 = time.perf_counter()
        timings.read_seconds = t1 - t0
        if before is not None:
            after = counters()
            timings.download_wait_seconds = after.get("wait_seconds", 0.0) - before.get("wait_seconds", 0.0)
            timings.download_wait_seconds += after.get("download_seconds", 0.0) - before.get("download_seconds", 0.0)
            timings.read_seconds = max(0.0, timings.read_seconds - timings.download_wait_seconds)
            for name in ("cache_hits", "cache_misses", "bytes_downloaded"):
                setattr(timings, name, int(after.get(name, 0) - before.get(name, 0)))
        if self.transform is not None:
            records = self._transform_all(task, records)
        batch = self.collate_fn(records)
        timings.transform_seconds = time.perf_counter() - t1
        return batch, timings

    def _transform_all(self, task: BatchTask, records: list[dict[str, Any]]) -> list[Any]:
        out = []
        transform = self.transform
        assert transform is not None
        # Global RNGs are process-wide: worker threads must take turns seeding and using them.
        with _GLOBAL_RNG_LOCK if self._seed_globals else _NoScope(), \
                GlobalRngScope() if self._seed_globals else _NoScope() as scope:
            for record in records:
                key = sample_key(self.seed, task.epoch, record["__index__"])
                if self._seed_globals:
                    scope.seed(key)
                if self._pass_generator:
                    result = transform(record, generator=sample_generator(key))
                else:
                    result = transform(record)
                if isinstance(result, dict):  # keep the bookkeeping fields through the transform
                    for name in ("__index__", "__key__"):
                        if name in record and name not in result:
                            result[name] = record[name]
                out.append(result)
        return out


_GLOBAL_RNG_LOCK = threading.Lock()


class _NoScope:
    def __enter__(self) -> _NoScope:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def pin(batch: Any) -> Any:
    """Pin every tensor in a (nested) batch; a no-op without CUDA."""
    if not torch.cuda.is_available():
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: pin(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(pin(v) for v in batch)
    return batch
