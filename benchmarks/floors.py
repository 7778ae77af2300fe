"""The floors under three of issue 24's goals, measured on this machine.

Issue 24 asks for (1) a user's own function over the built-in transforms at >= 0.95 of the
README transform's samples/s, and (2) a stall of <= 1% with a consumer at 80% of capacity.
This benchmark measures what bounds each, whatever the loader does:

* **own-function floor** (one process, one thread, the same 64 samples read and made into
  batch rows, best of `--repeats` passes, microseconds a sample):
  - `fused`: what the README path does per sample (`DecodeCropFlip.into` a scratch image,
    then its CHW planes into the batch row);
  - `user's work`: what the user's function does itself (`DecodeCropFlip` and `ToTensor`
    calls) plus the one copy of its tensor into the batch row that any collate makes, with no
    loader bookkeeping at all;
  - `Loader, README` and `Loader, user's function`: the Loader's own per-batch producers
    (`BatchProducer`) for the two, as a worker runs them.
  The Loader's README path ÷ `user's work` is the most the user's function can reach through
  the Loader: everything the Loader adds to it (seeding torch's global generator per sample
  for I3 and watching the others, the checks that make the batch `default_collate`'s, carrying
  `__index__`) comes off it.
* **wake-up cost**: a process that waits for its next task must be woken by whoever hands it
  one. After a 13 ms sleep (a training step that waits for its GPU), the writer pays for the
  wake-up inside the call: a 60-byte pipe write (the task pipe) and a semaphore release
  (a futex) to a blocked process, median of `--wakes`.
* **ready next()**: a warm Loader (README transform, 2 workers) and a consumer that sleeps
  `--step-ms` per batch: the median time of a `next()` that finds its batch ready (the
  consumer is slower than the workers), and that median x batches / wall time: the stall a
  loader with no late batch at all would still show at that step length.

    .venv/bin/python -m benchmarks.floors            # 3,000 images, ~1 min
    .venv/bin/python -m benchmarks.floors --n 600 --repeats 3 --wakes 50 --batches 40   # smoke
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks._common import load_average, machine
from benchmarks._images import prepare_images
from benchmarks.peers import BATCH, SIZE, WORKERS, loader_transform, own_transform
from shardloader import Dataset, Loader
from shardloader.loader.batches import BatchProducer, BatchTask
from shardloader.transforms import DecodeCropFlip
from shardloader.transforms.tensor import copy_into, hwc_to_chw

_CROP = DecodeCropFlip(SIZE)


def fused_rows(dataset: Dataset, samples: np.ndarray, rows: np.ndarray, generator: torch.Generator,
               hwc: np.ndarray, scratch: np.ndarray) -> None:
    """The README path's per-sample work: each sample's rows read, `DecodeCropFlip.into` a
    scratch image (its generator seeded with the sample's number), its CHW planes into `rows`."""
    for i, record in enumerate(dataset.get_many(samples)):
        generator.manual_seed(i)
        _CROP.into(record, hwc, generator, scratch)
        hwc_to_chw(hwc, rows[i])


def user_rows(dataset: Dataset, samples: np.ndarray, rows: np.ndarray, generator: torch.Generator) -> None:
    """The user's function's own work (`peers.own_transform`: `DecodeCropFlip` and `ToTensor`
    calls, its dict) and the one copy any collate makes: the same rows as `fused_rows`."""
    for i, record in enumerate(dataset.get_many(samples)):
        generator.manual_seed(i)
        copy_into(rows[i], own_transform(record, generator=generator)["img"].numpy())


def own_function_floor(arrow_dir: str, repeats: int) -> dict[str, float]:
    """Microseconds a sample (best of `repeats` passes over one batch: its rows read, then
    each made into its batch row) of each way (see the module doc)."""
    torch.set_num_threads(1)
    dataset = Dataset(arrow_dir)
    samples = np.arange(min(BATCH, len(dataset)))
    rows = np.empty((len(samples), 3, SIZE, SIZE), dtype=np.uint8)
    hwc, scratch = np.empty((SIZE, SIZE, 3), np.uint8), np.empty((SIZE, SIZE, 3), np.uint8)
    generator = torch.Generator()
    readme = BatchProducer(dataset, seed=0, transform=loader_transform("readme"))
    own = BatchProducer(dataset, seed=0, transform=own_transform)
    ways: dict[str, Callable[[], Any]] = {
        "fused": lambda: fused_rows(dataset, samples, rows, generator, hwc, scratch),
        "user's work": lambda: user_rows(dataset, samples, rows, generator),
        "Loader, README": lambda: readme(BatchTask(0, 0, 0, samples)),
        "Loader, user's function": lambda: own(BatchTask(0, 0, 0, samples)),
    }
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeats):  # interleaved, so that the machine's drifts hit each alike
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            best[name] = min(best[name], (time.perf_counter() - start) / len(samples) * 1e6)
    return best


def _read_pipe(fd: int, count: int) -> None:
    for _ in range(count):
        os.read(fd, 64)


def _acquire(semaphore: Any, count: int) -> None:
    for _ in range(count):
        semaphore.acquire()


def wake_cost(wakes: int, sleep_s: float = 0.013) -> dict[str, float]:
    """Median microseconds the waker spends handing a blocked process its next task, after
    sleeping `sleep_s`: a 60-byte pipe write, and a semaphore release."""
    context = multiprocessing.get_context("fork")
    out = {}
    read_end, write_end = os.pipe()
    semaphore = context.Semaphore(0)
    ways: list[tuple[str, Callable[[], Any], Any, tuple]] = [
        ("pipe write", lambda: os.write(write_end, b"t" * 60), _read_pipe, (read_end, wakes)),
        ("semaphore release", semaphore.release, _acquire, (semaphore, wakes)),
    ]
    try:
        for name, wake, wait, args in ways:
            waiter = context.Process(target=wait, args=args, daemon=True)
            waiter.start()
            times = []
            for _ in range(wakes):
                time.sleep(sleep_s)
                start = time.perf_counter()
                wake()
                times.append(time.perf_counter() - start)
            waiter.join(10)
            out[name] = statistics.median(times) * 1e6
    finally:
        os.close(read_end)
        os.close(write_end)
    return out


def ready_next(arrow_dir: str, step_ms: float, batches: int, batch_size: int = BATCH) -> dict[str, float]:
    """The median `next()` of a warm Loader whose consumer sleeps `step_ms` per batch, over
    the batches that found theirs ready, and that median x batches / wall time. An epoch's
    first batch is not timed (it waits for the workers to start on the epoch)."""
    loader = Loader(Dataset(arrow_dir), batch_size=batch_size, shuffle=True, num_workers=WORKERS,
                    seed=0, transform=loader_transform("readme"),
                    persistent_workers=True)
    if len(loader) < 2:
        loader.close()
        raise ValueError(f"{arrow_dir}: {len(loader)} batch of {batch_size} an epoch; ready next() "
                         "times an epoch's batches after its first, so it needs two at least")
    waits: list[float] = []
    try:
        for _ in loader:  # workers started, pages cached
            pass
        epoch, started = 1, None
        while len(waits) < batches:
            loader.set_epoch(epoch)
            epoch += 1
            batch_iter = iter(loader)
            first = True
            while len(waits) < batches:
                start = time.perf_counter()
                try:
                    next(batch_iter)
                except StopIteration:
                    break
                if first:  # an epoch's first batch waits for its workers to start it
                    first = False
                else:
                    waits.append(time.perf_counter() - start)
                    started = started if started is not None else start
                time.sleep(step_ms / 1000)
        wall = time.perf_counter() - (started or 0.0)
    finally:
        loader.close()
    # a wait over a step's length was a late batch, not a ready one
    ready = [w for w in waits if w < step_ms / 1000]
    median = statistics.median(ready)
    return {"median_us": median * 1e6, "ready": len(ready), "of": len(waits),
            "floor": median * len(waits) / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3_000, help="images (default 3,000)")
    parser.add_argument("--repeats", type=int, default=30, help="passes per way (own-function floor)")
    parser.add_argument("--wakes", type=int, default=300, help="wake-ups per way")
    parser.add_argument("--step-ms", type=float, default=13.0, help="the consumer's step (ready next())")
    parser.add_argument("--batches", type=int, default=300, help="batches timed (ready next())")
    args = parser.parse_args(argv)
    images = prepare_images(args.n, log=print)
    print(f"floors: {machine()}, {load_average()}")
    floor = own_function_floor(images.arrow_dir, args.repeats)
    print(f"own-function floor: us a sample, best of {args.repeats} passes over {BATCH} samples; "
          "Loader's README path ÷ each (user's work: the most the user's function can reach)")
    for name, us in floor.items():
        print(f"  {name:<26} {us:7.1f}   {floor['Loader, README'] / us:.3f}")
    wakes = wake_cost(args.wakes)
    print(f"wake-up cost after a 13 ms sleep: median of {args.wakes}")
    for name, us in wakes.items():
        print(f"  {name:<26} {us:7.1f} us")
    ready = ready_next(images.arrow_dir, args.step_ms, args.batches)
    print(f"ready next() with a {args.step_ms:g} ms step: median {ready['median_us']:.0f} us over "
          f"{ready['ready']} of {ready['of']} batches; stall floor {ready['floor']:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
