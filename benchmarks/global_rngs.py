"""What per-sample seeding of the global RNGs costs a realistic sample (issue 37).

A user's function that neither takes `generator=` nor declares `uses_global_rng` gets
`random`, `numpy.random` and torch's generator seeded per sample (I3). Three ways, each around
the same sample - decode and random-resized-crop of an ImageNet-sized JPEG (~110 KB, 350-420
px, `DecodeCropFlip(224)`, drawing from torch's global generator) - in one process, as a
worker runs them:

* none: the function given `generator=` (no global seeding at all: the floor);
* eager: `random.seed`, `np.random.seed`, torch's seed before every sample (`GlobalRngScope`);
* lazy: `LazyGlobalRngScope`, torch seeded, `random` and numpy only once seen drawn from
  (their state read in place through ctypes, `shardloader.order.global_rngs`).

Batches of 64 alternate between the three (so load from other processes hits them alike);
per-sample figures are medians over rounds. On a loaded machine the difference of two ~2 ms
samples is noisy, so the RNG work alone is also timed in a tight loop (1,000 keys, median of
7): the eager seeding, and the lazy scope's `run` around a function that draws nothing (its
per-sample bookkeeping). The extra cost of eager over lazy (the tight-loop figure) is then put
beside a training step: per batch of 64 and 256 samples, against a 50 and 200 ms step, for one
worker's CPU and spread over 8 workers (the share of a step's wall time the loader would lose
if it were the bottleneck).

    .venv/bin/python -m benchmarks.global_rngs [--rounds 15] [--images 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import load_average, machine
from benchmarks._images import imagenet_like_jpegs
from shardloader.order.global_rngs import LazyGlobalRngScope
from shardloader.order.seeding import GlobalRngScope, sample_keys
from shardloader.transforms import DecodeCropFlip

BATCH = 64
CROP = DecodeCropFlip(224)


def _none(records: list[dict], keys: list[int]) -> None:
    generator = torch.Generator()
    for record, key in zip(records, keys):
        generator.manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
        CROP(record, generator=generator)


def _eager(records: list[dict], keys: list[int]) -> None:
    with GlobalRngScope() as scope:
        for record, key in zip(records, keys):
            scope.seed(key)
            CROP(record)


_IN_USE: set[str] = set()


def _lazy(records: list[dict], keys: list[int]) -> None:
    with LazyGlobalRngScope(_IN_USE) as scope:
        for record, key in zip(records, keys):
            scope.run(key, lambda watching, record=record: CROP(dict(record) if watching else record))


def _tight(fn: object, keys: list[int]) -> float:
    """Microseconds per key of `fn(key)`, median of 7 passes over `keys`."""
    passes = []
    for _ in range(7):
        t = time.perf_counter()
        for key in keys:
            fn(key)  # type: ignore[operator]
        passes.append((time.perf_counter() - t) / len(keys) * 1e6)
    return statistics.median(passes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--images", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in a loader worker
    jpegs = imagenet_like_jpegs(args.images)
    records = [{"image": b, "label": i % 10} for i, b in enumerate(jpegs)]
    ways = {"none": _none, "eager": _eager, "lazy": _lazy}
    per_sample: dict[str, list[float]] = {name: [] for name in ways}
    differences: list[float] = []  # eager - lazy, per batch (paired: the same load)
    for r in range(args.rounds + 1):
        for start in range(0, len(records) - BATCH + 1, BATCH):
            batch = records[start:start + BATCH]
            keys = sample_keys(0, r, list(range(start, start + BATCH)))
            for name, way in ways.items():
                t = time.perf_counter()
                way(batch, keys)
                if r:  # round 0 warms up (and lets the lazy scope see the function)
                    per_sample[name].append((time.perf_counter() - t) / BATCH)
            if r:
                differences.append(per_sample["eager"][-1] - per_sample["lazy"][-1])
    us = {name: statistics.median(v) * 1e6 for name, v in per_sample.items()}
    paired = statistics.median(differences) * 1e6
    keys = sample_keys(0, 99, list(range(1000)))
    with GlobalRngScope() as eager_scope:
        eager_us = _tight(eager_scope.seed, keys)
    with LazyGlobalRngScope(set()) as lazy_scope:
        lazy_us = _tight(lambda key: lazy_scope.run(key, lambda watching: None), keys)
    extra = eager_us - lazy_us
    print(f"{machine()}, load {load_average()}; {len(jpegs)} JPEGs, median "
          f"{statistics.median(len(b) for b in jpegs) / 1024:.0f} KiB; {args.rounds} rounds")
    for name in ways:
        print(f"  {name:6s} {us[name]:8.1f} us/sample  ({us[name] / us['none']:.3f} of none)")
    print(f"eager - lazy, per-batch differences of whole samples: {paired:.1f} us/sample (noisy)")
    print(f"RNG work alone: eager seeding {eager_us:.1f} us/sample, lazy bookkeeping {lazy_us:.1f}: "
          f"eager - lazy {extra:.1f} us = {extra / us['none']:.2%} of a sample's work")
    for batch in (64, 256):
        for step_ms in (50, 200):
            per_batch_ms = extra * batch / 1e3
            print(f"  batch {batch:3d}, step {step_ms:3d} ms: {per_batch_ms:.2f} ms of one worker's CPU "
                  f"a batch = {per_batch_ms / step_ms:.2%} of a step; over 8 workers "
                  f"{per_batch_ms / 8 / step_ms:.2%}")


if __name__ == "__main__":
    main()
