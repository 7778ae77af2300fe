"""A two-source Mixture and a weighted sampler against the single-dataset shuffle on the same
images (issue 38).

The benchmark image set (`benchmarks/_images.py`, cached under benchmarks/out/) is read three
times:

* single: `Loader(Dataset(arrow), shuffle=True)`, the Loader's own order;
* mixture: the same images written as two Arrow datasets, the first and the second half
  (`mix-a`, `mix-b`, cached beside the set), read as `Mixture({"a": (A, 0.5), "b": (B, 0.5)})`
  with `shuffle=True`: the mixture's own order (interleave by weight, per-source passes), each
  source's samples of a batch read in one `get_many`, per-source counters;
* weighted: the single dataset with `sampler=WeightedSampler(weights, n)` (per-sample weights
  1..10 by label, with replacement, n samples an epoch: what `WeightedRandomSampler` is used
  for against class imbalance), a pure sampler computed in the workers like the own order.

All three decode, random-resized-crop to 112 px and flip (`DecodeCropFlip`) in batches of 64 with 2
process workers, persistent. One warm-up epoch each, then `--rounds` rounds of one epoch of each,
taking turns (the order reversed every other round), so that load from other processes hits both
alike. Samples/s and CPU per sample (this process and its workers) are medians over rounds; the
ratios to the single shuffle are medians of per-round ratios (goal: >= 0.97). On a loaded machine the wall-time
ratio swings with other processes' load; the CPU ratio is the steadier figure of the two.

    .venv/bin/python -m benchmarks.mixture [--n 6000] [--rounds 5] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks._common import (
    cpu_used,
    emit,
    load_average,
    machine,
    median,
    spread,
    table,
    tree_cpu_seconds,
)
from benchmarks._images import SAMPLES_PER_SHARD, SHARDS_VERSION, ImageSet, _build, prepare_images

BATCH, WORKERS, SIZE = 64, 2, 112


def prepare_halves(images: ImageSet) -> tuple[str, str]:
    """The image set's first and second halves as two Arrow datasets (written once)."""
    from shardloader.ingest.writer import write_shards

    half = images.n // 2
    paths = []
    for name, ids in (("mix-a", range(half)), ("mix-b", range(half, images.n))):
        path = images.layout_dir(name)

        def make(tmp: str, ids: range = ids) -> None:
            write_shards(({"image": images.read_jpeg(i), "label": i % 10} for i in ids), tmp,
                         shard_samples=SAMPLES_PER_SHARD, overwrite=True)

        _build(path, make, f"Arrow shards of samples {ids.start}..{ids.stop - 1}", print, SHARDS_VERSION)
        paths.append(path)
    return paths[0], paths[1]


def loaders(images: ImageSet, workers: int = WORKERS) -> dict[str, Any]:
    import numpy as np

    from shardloader import Dataset, Loader, Mixture, WeightedSampler
    from shardloader.transforms import DecodeCropFlip

    a, b = prepare_halves(images)
    common = dict(batch_size=BATCH, num_workers=workers, seed=0, persistent_workers=workers > 0)
    weights = 1.0 + np.arange(images.n) % 10  # by label (i % 10): classes 1..10 times as likely
    return {
        "single": Loader(Dataset(images.arrow_dir), transform=DecodeCropFlip(SIZE), shuffle=True, **common),
        "mixture": Loader(Mixture({"a": (Dataset(a), 0.5), "b": (Dataset(b), 0.5)}),
                          transform=DecodeCropFlip(SIZE), shuffle=True, **common),
        "weighted": Loader(Dataset(images.arrow_dir), transform=DecodeCropFlip(SIZE),
                           sampler=WeightedSampler(weights, images.n, replacement=True), **common),
    }


def epoch_rate(loader: Any) -> tuple[float, float]:
    """(samples/s, CPU microseconds per sample of this process and its workers) of one epoch."""
    samples, cpu, start = 0, tree_cpu_seconds(), time.perf_counter()
    for batch in loader:
        samples += int(batch["image"].shape[0])
    seconds = time.perf_counter() - start
    return samples / seconds, cpu_used(cpu, tree_cpu_seconds()) / samples * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help="0: everything in this process (CPU per sample is then the steadiest figure)")
    parser.add_argument("--json")
    args = parser.parse_args()
    images = prepare_images(args.n)
    built = loaders(images, args.workers)
    for loader in built.values():  # warm-up: workers started, shards in the page cache
        epoch_rate(loader)
    rates: dict[str, list[float]] = {name: [] for name in built}
    cpu: dict[str, list[float]] = {name: [] for name in built}
    for round_ in range(args.rounds):
        for name in sorted(built, reverse=bool(round_ % 2)):  # each goes first every other round
            rate, us = epoch_rate(built[name])
            rates[name].append(rate)
            cpu[name].append(us)
    others = [name for name in built if name != "single"]
    ratios = {name: [o / s for o, s in zip(rates[name], rates["single"], strict=True)] for name in others}
    cpu_ratios = {name: [s / o for o, s in zip(cpu[name], cpu["single"], strict=True)] for name in others}
    stats = built["mixture"].stats()
    for loader in built.values():
        loader.close()
    rows = [[name, f"{median(r):,.0f}", spread(r), f"{median(cpu[name]):,.0f}",
             "1" if name == "single" else f"{median(ratios[name]):.3f} ({spread(ratios[name])})",
             "1" if name == "single" else f"{median(cpu_ratios[name]):.3f} ({spread(cpu_ratios[name])})"]
            for name, r in rates.items()]
    text = "\n".join([
        f"A two-source Mixture and a WeightedSampler vs the single-dataset shuffle, {images.n} images, "
        f"batch {BATCH}, {args.workers} process workers, DecodeCropFlip({SIZE}); {args.rounds} rounds",
        f"machine: {machine()}; load: {load_average()}; pid {os.getpid()}",
        table(["loader", "samples/s (median)", "range", "CPU us/sample (median)",
               "/ single, samples/s (median of rounds)", "single /, CPU per sample"], rows),
        "mixture's per-source summary: " + ", ".join(
            f"{k}={v:,.3g}" for k, v in stats.items() if k.startswith("source.")),
    ])
    emit(text, {"rates": rates, "cpu_us": cpu, "ratios": ratios, "cpu_ratios": cpu_ratios, "n": images.n},
         args.json)


if __name__ == "__main__":
    main()
