"""Producing one batch: read rows, transform each sample under its key, collate.

This is what a worker does for each task. It depends only on the task (epoch, sample
indices), the dataset and the transform — never on which worker runs it or on any RNG stream —
so the batches are the same for every `num_workers` and world size (I1, I3). The dataset is
read through `shardloader.loader.protocol` only, its source through `ShardSource`.
"""

from __future__ import annotations

import copy
import importlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardloader.loader.collate import Allocate, BatchBuilder, collate
from shardloader.loader.failures import SampleFailed
from shardloader.loader.protocol import KeyedReads, LoaderDataset, ReadsBySource, stateful_part
from shardloader.order.global_rngs import LazyGlobalRngScope
from shardloader.order.seeding import sample_keys
from shardloader.runtime.startup import paused_gc
from shardloader.source.protocol import BATCH_COUNTERS, counter_delta, job_counter_delta
from shardloader.telemetry.records import worker_figures
from shardloader.transforms.base import Compose, accepts_generator
from shardloader.transforms.fused import DecodeCropFlip
from shardloader.transforms.tensor import ToTensor, hwc_to_chw

Transform = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class BatchTask:
    """One batch to produce: `samples` are global sample indices in output order, or None to
    let the producer compute them from (epoch, step) with its StepPlan (off the training
    thread). `size` is the number of samples either way. `start`: for an iterable dataset's
    worker, set on its first task of a pass: what to do before iterating (see
    `shardloader.loader.iterable_workers`)."""

    task_id: int
    epoch: int
    step: int
    samples: np.ndarray | None
    padded: int = 0
    size: int = -1
    start: dict[str, Any] | None = None


@dataclass
class BatchTimings:
    """What a worker measured on one batch. `figures`: the worker-measured fields of
    telemetry's `BatchRecord` by name (`records.WORKER_FIELDS`: where its time went, in
    seconds, and its cache counters), which the training process copies into the batch's
    record as they are; a new worker figure is set here by name and declared in `BatchRecord`.
    `extra`: counters for the job's account only (`source.protocol.JOB_COUNTERS`)."""

    figures: dict[str, float] = field(default_factory=worker_figures)
    extra: dict[str, float] = field(default_factory=dict)
    #: A dataset of named sources (`protocol.ReadsBySource`): what reading this batch cost per
    #: source ({name: {figure: amount}}), summed by `Loader.stats()`. None for other datasets.
    by_source: dict[str, dict[str, float]] | None = None
    #: A dataset with a state (`protocol.Stateful`): its `state_dict()` right after this batch
    #: was made, in the process that made it (the Loader saves the last delivered batch's).
    dataset_state: Any = None


def source_delta(before: dict[str, dict[str, float]],
                 after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per source, the figures gained between two `ReadsBySource.by_source()` readings (the
    sources a batch did not read left out)."""
    out = {}
    for name, now in after.items():
        was = before.get(name, {})
        gained = {figure: value - was.get(figure, 0) for figure, value in now.items()}
        if any(gained.values()):
            out[name] = gained
    return out


def uses_global_rng(transform: Transform | None) -> bool:
    """Whether global RNGs must be seeded per sample: yes unless the transform says otherwise."""
    if transform is None:
        return False
    return bool(getattr(transform, "uses_global_rng", True))


class BatchProducer:
    """Turns a BatchTask into a collated batch. Picklable: it travels into worker processes."""

    def __init__(
        self,
        dataset: LoaderDataset,
        *,
        seed: int,
        transform: Transform | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_init_fn: Callable[[int], Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self.transform = transform
        self.collate_fn = collate_fn or collate
        self.worker_init_fn = worker_init_fn
        self._pass_generator = transform is not None and accepts_generator(transform)
        # A map-style dataset that augments in `dataset[i]` reads each sample under its key.
        self._keyed: KeyedReads | None = (dataset if isinstance(dataset, KeyedReads) and dataset.keyed_reads
                                          else None)
        self._seed_globals = uses_global_rng(transform)
        #: The global RNGs this process has seen the transform draw from (seeded per sample).
        self._globals_in_use: set[str] = set()
        self._direct = direct_batch_transform(transform, self.collate_fn)
        self._reads_by_source = isinstance(dataset, ReadsBySource)  # a Mixture: figures per source
        #: What holds the dataset's own state (a user's dataset with state_dict), or None.
        self._stateful = stateful_part(dataset)

    #: Set in a worker process: its cache counters then belong to the batches it produces.
    #: In the training process (num_workers=0, or threads) the Loader takes the process-wide
    #: counters itself, once per delivered batch, so nothing is counted twice.
    report_cache_counters = False
    #: The Loader's StepPlan, for tasks that carry (epoch, step) instead of samples.
    plan: Any = None
    #: Set by a worker process to its id: `worker_init_fn(worker_id)` then runs before the
    #: process's first batch (inside the task, so a failure is reported with that batch).
    worker_id: int | None = None
    #: A dataset state to load into this worker process's copy of the dataset before its first
    #: batch (after worker_init_fn, as StatefulDataLoader): set by `Loader.load_state_dict`
    #: for the workers started next (`PoolKeeper.get` clears it once they are).
    dataset_state: Any = None
    #: Set by a worker process to its SlotWriter's `allocate`: the direct batch path then
    #: builds the image tensor inside a shared-memory slot, which `pack` sends without a copy.
    allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
    #: Set by a worker process to its SlotWriter's `allocate_many`: the general path then
    #: collates the batch's arrays into a shared-memory slot (`BatchBuilder`), which `pack`
    #: sends without a copy.
    allocate_many: Allocate | None = None

    def __call__(self, task: BatchTask) -> tuple[Any, BatchTimings]:
        timings = BatchTimings()
        figures = timings.figures
        source = self.dataset.source
        before = source.counters() if self.report_cache_counters and source.counts_reads else None
        wait_before = self.dataset.shard_wait_seconds()
        by_source = self.dataset.by_source() if self._reads_by_source else None
        if self.worker_id is not None:
            worker_id, self.worker_id = self.worker_id, None  # once per process
            if self.worker_init_fn is not None:
                self.worker_init_fn(worker_id)
            if self.dataset_state is not None and self._stateful is not None:
                self._stateful.load_state_dict(copy.deepcopy(self.dataset_state))
        t0 = time.perf_counter()
        samples = task.samples
        if samples is None:
            if self.plan is None:
                raise ValueError(f"batch task {task.task_id} has no samples and the producer no StepPlan")
            samples = self.plan.samples(task.epoch, task.step)
        try:
            if self._keyed is not None:
                records = self._keyed.read_keyed(samples, sample_keys(self.seed, task.epoch, samples),
                                                 _GLOBAL_RNG_LOCK)
            else:
                records = self.dataset.get_many(samples)
        except SampleFailed:
            raise
        except Exception as e:  # noqa: BLE001 - a read of several samples (a shard's rows)
            raise SampleFailed(e, None) from None
        t1 = time.perf_counter()
        # Waiting for shard files (a download, another process's download, verification) is
        # measured by this thread alone, so prefetch threads' downloads never inflate it.
        shard_wait = figures["shard_wait_seconds"] = self.dataset.shard_wait_seconds() - wait_before
        figures["read_seconds"] = max(0.0, t1 - t0 - shard_wait)
        if by_source is not None:
            timings.by_source = source_delta(by_source, self.dataset.by_source())
        if before is not None:
            after = source.counters()
            figures.update(zip(BATCH_COUNTERS, counter_delta(before, after), strict=True))
            timings.extra.update(job_counter_delta(before, after))
        batch = self._direct_batch(task, records, samples) if self._direct is not None else None
        if batch is None:
            if self.collate_fn is collate and records:
                batch = self._built_batch(task, records, samples)
            else:
                if self.transform is not None:
                    records = self._transform_all(task, records, samples)
                batch = self.collate_fn(records)
        figures["transform_seconds"] = time.perf_counter() - t1
        if self._stateful is not None:  # a copy: the dataset goes on changing it
            timings.dataset_state = copy.deepcopy(self._stateful.state_dict())
        return batch, timings

    def warm_up(self) -> None:
        """Import here what producing a batch imports lazily, before worker processes fork.

        Forked workers inherit this process's modules (their pages shared copy-on-write)
        instead of each importing numpy.random, the shard reader stack (for Arrow and Parquet,
        pyarrow: its formats' code is loaded with it, `format.registry`) and the image libraries
        before its first batch (tests/test_startup.py: a worker imports no module the training
        process had not). For a local dataset one sample is read (a reader's first read loads
        what it loads lazily); a remote one would download a shard, so there only the modules
        are imported. Failures are left for the workers to report with their full context.

        The garbage collector is paused meanwhile (`shardloader.runtime.startup`): loading
        pyarrow and OpenCV creates many objects and, in a process that holds torch, triggered
        full collections over its whole heap; the two imports took 116-142 ms of CPU with
        collections and 42-45 ms without, on the path to the first batch.
        """
        with paused_gc():
            self._import_and_read()

    def _import_and_read(self) -> None:
        # numpy.random: numpy imports it on first use, and every worker uses it before its first
        # task (seeded at set-up, as DataLoader seeds it): 10-20 ms and 2.7 MB of private memory
        # per worker when each imported it itself (benchmarks/coldstart.py's "worker: set-up to
        # first task"); numpy.ctypeslib, with which the global-RNG scope of a user's transform
        # reads its state (`shardloader.order.global_rngs`); then what shardloader.transforms load.
        for name in ("numpy.random", "numpy.ctypeslib", "cv2", "simplejpeg"):
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        try:
            if self._direct is not None:  # check the JPEG crop decoder once, for every worker
                from shardloader.transforms.decode import crop_decoder_on

                crop_decoder_on()
            self.dataset.warm_up()  # its formats' reader code, and a first read where cheap
        except Exception:  # noqa: BLE001 - an optimisation only; workers raise the real error
            pass

    def _direct_batch(self, task: BatchTask, records: list[Any], samples: np.ndarray) -> Any:
        """The batch of a `DecodeCropFlip` (optionally followed by `ToTensor()`, uint8 CHW) with
        the default collate, each image written by the transform straight into the batch
        tensor: the same bytes, keys and types as `collate([transform(r, generator=g_i) for r
        in records])` (tests compare them), without a dict and an image array per sample and
        without collate's copy of every image. None when the records are not all dicts with
        the same fields (then the general path runs).

        Measured with the worker's slot (2 cores, 128-256 px JPEGs to 112 px, batch 64,
        together with the one-draw crop box): process-tree CPU per sample -6 to -9%.
        """
        assert self._direct is not None
        transform, chw = self._direct
        first = records[0] if records else None
        if type(first) is not dict or not all(type(r) is dict and r.keys() == first.keys()
                                             for r in records):
            return None
        keys = sample_keys(self.seed, task.epoch, samples)
        shape = transform.batch_shape()
        height, width, channels = shape
        batch_shape = (len(records), channels, height, width) if chw else (len(records), *shape)
        images = (self.allocate(batch_shape, torch.uint8) if self.allocate is not None
                  else torch.empty(batch_shape, dtype=torch.uint8))
        array = images.numpy()
        scratch = np.empty(shape, dtype=np.uint8)
        hwc = np.empty(shape, dtype=np.uint8) if chw else None
        generator = torch.Generator()
        for i, (record, key) in enumerate(zip(records, keys)):
            generator.manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
            try:
                if hwc is None:
                    transform.into(record, array[i], generator, scratch)
                else:  # ToTensor: HWC -> CHW, as it does
                    transform.into(record, hwc, generator, scratch)
                    hwc_to_chw(hwc, array[i])
            except Exception as e:  # noqa: BLE001 - reported for this sample
                raise SampleFailed(e, int(samples[i])) from None
        out = transform.out
        fields = list(first) + ([] if out in first else [out])
        return {name: images if name == out else self.collate_fn([r[name] for r in records])
                for name in fields}

    def _built_batch(self, task: BatchTask, records: list[Any], samples: np.ndarray) -> Any:
        """The default collate's batch, each sample collated as soon as it is made, its arrays
        straight into the batch tensors (in a worker, in its shared-memory slot): see
        `BatchBuilder`. The same batch as `collate(transformed records)`, for any transform.

        What it saves is small beside a sample's decode (measured on a shared 2-core machine,
        128-256 px JPEGs to 112 px, batch 64, a user's function over DecodeCropFlip + ToTensor
        returning {"img", "label"}: 329 us of CPU per sample in a worker's loop against 335
        through `collate` and the slot copy). Most of the rest of the gap to the fused path
        (`_direct_batch`) was ToTensor's per-sample CHW copy, now a view that this collate
        copies once (`transforms.tensor.copy_into`): 262 -> 231-235 us a sample against the
        fused path's 216-221, in one process. The global RNGs cost ~2 us once the transform
        is seen not to draw from them (`global_rngs`): benchmarks/handoff.py measures each."""
        builder = BatchBuilder(len(records), self.allocate_many)
        if self.transform is not None:
            self._transform_all(task, records, samples, builder.add)
        else:
            for record in records:
                builder.add(record)
        return builder.finish()

    def _transform_all(self, task: BatchTask, records: list[dict[str, Any]], samples: np.ndarray,
                       sink: Callable[[Any], None] | None = None) -> list[Any]:
        """Each record transformed under its sample's key, in order: the results, or, with
        `sink`, each result handed to it as soon as it is made (and an empty list)."""
        out: list[Any] = []
        if sink is None:
            sink = out.append
        transform = self.transform
        assert transform is not None
        keys = sample_keys(self.seed, task.epoch, samples)  # records are in task order
        # One generator per batch, re-seeded for each sample: the same draws as a fresh
        # generator per sample (`sample_generator`), without allocating 64 of them.
        generator = torch.Generator() if self._pass_generator else None
        if not self._seed_globals:
            for i, (record, key) in enumerate(zip(records, keys)):
                sink(self._apply(transform, record, generator, key, samples[i]))
            return out
        # Global RNGs are process-wide: worker threads must take turns seeding and using them.
        # `random` and `numpy` are seeded only once the transform is seen drawing from them:
        # a sample that drew from one unseeded runs again with it seeded (`global_rngs`).
        with _GLOBAL_RNG_LOCK, LazyGlobalRngScope(self._globals_in_use) as scope:
            for i, (record, key) in enumerate(zip(records, keys)):
                sample = samples[i]
                sink(scope.run(key, lambda watching, record=record, key=key, sample=sample: self._apply(
                    transform, _copy(record) if watching else record, generator, key, sample)))
        return out

    def _apply(self, transform: Transform, record: Any, generator: torch.Generator | None, key: int,
               sample: Any) -> Any:
        """One sample transformed under its key's generator; its error as `SampleFailed`."""
        try:
            if generator is not None:
                generator.manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
                result = transform(record, generator=generator)
            else:
                result = transform(record)
        except Exception as e:  # noqa: BLE001 - reported for this sample
            raise SampleFailed(e, int(sample)) from None
        if result is None:
            raise SampleFailed(TypeError(
                f"the transform {transform!r} returned None for sample {int(sample)}: "
                f"a transform must return the (transformed) sample"), int(sample))
        if isinstance(result, dict):  # keep the bookkeeping fields through the transform
            for name in ("__index__", "__key__"):
                if name in record and name not in result:
                    result[name] = record[name]
        return result


def _copy(record: Any) -> Any:
    """A shallow copy of a dict or list record (what a transform may change in place)."""
    if type(record) is dict:
        return dict(record)
    if type(record) is list:
        return list(record)
    return record


def direct_batch_transform(transform: Any, collate_fn: Any) -> tuple[DecodeCropFlip, bool] | None:
    """(the DecodeCropFlip, whether a ToTensor follows it) if batches can take the direct path
    (`BatchProducer._direct_batch`): with the default collate, a `DecodeCropFlip` (not a
    subclass that changes how a sample is made) whose output `into` can write, alone or as
    `Compose([DecodeCropFlip(...), ToTensor()])` (uint8, on its output field); else None."""
    if collate_fn is not collate:
        return None
    chw = False
    if type(transform) is Compose and len(transform.transforms) == 2:
        transform, after = transform.transforms
        if not (type(after) is ToTensor and after.dtype == torch.uint8
                and after.field == getattr(transform, "out", None)):
            return None
        chw = True
    if (isinstance(transform, DecodeCropFlip)
            and type(transform).__call__ is DecodeCropFlip.__call__
            and type(transform).into is DecodeCropFlip.into
            and transform.batch_shape() is not None):
        return transform, chw
    return None


_GLOBAL_RNG_LOCK = threading.Lock()


def _new_rng_lock_in_child() -> None:
    """A forked worker gets a fresh lock: if another thread of the parent (a second loader, a
    torchdata Prefetcher running a loader inline) held it at the fork, the child's copy would
    stay locked forever and the worker would never produce a batch."""
    global _GLOBAL_RNG_LOCK
    _GLOBAL_RNG_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_rng_lock_in_child)
