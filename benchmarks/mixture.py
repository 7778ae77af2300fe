"""A two-source Mixture against the single-dataset shuffle on the same images (issue 38).

The benchmark image set (`benchmarks/_images.py`, cached under benchmarks/out/) is read twice:

* single: `Loader(Dataset(arrow), shuffle=True)`, the Loader's own order;
* mixture: the same images written as two Arrow datasets, the first and the second half
  (`mix-a`, `mix-b`, cached beside the set), read as `Mixture({"a": (A, 0.5), "b": (B, 0.5)})`
  with `shuffle=True`: the mixture's own order (interleave by weight, per-source passes), each
  source's samples of a batch read in one `get_many`, per-source counters.

Both decode, random-resized-crop to 112 px and flip (`DecodeCropFlip`) in batches of 64 with 2
process workers, persistent. One warm-up epoch each, then `--rounds` rounds of one epoch of each,
taking turns, so that load from other processes hits both alike. Samples/s are medians over
rounds; the ratio is the median of per-round ratios (goal: >= 0.97).

    .venv/bin/python -m benchmarks.mixture [--n 6000] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks._common import emit, load_average, machine, median, spread, table
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


def loaders(images: ImageSet) -> dict[str, Any]:
    from shardloader import Dataset, Loader, Mixture
    from shardloader.transforms import DecodeCropFlip

    a, b = prepare_halves(images)
    common = dict(batch_size=BATCH, num_workers=WORKERS, shuffle=True, seed=0, persistent_workers=True)
    return {
        "single": Loader(Dataset(images.arrow_dir), transform=DecodeCropFlip(SIZE), **common),
        "mixture": Loader(Mixture({"a": (Dataset(a), 0.5), "b": (Dataset(b), 0.5)}),
                          transform=DecodeCropFlip(SIZE), **common),
    }


def epoch_rate(loader: Any) -> float:
    samples, start = 0, time.perf_counter()
    for batch in loader:
        samples += int(batch["image"].shape[0])
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    images = prepare_images(args.n)
    built = loaders(images)
    for loader in built.values():  # warm-up: workers started, shards in the page cache
        epoch_rate(loader)
    rates: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(args.rounds):
        for name, loader in built.items():
            rates[name].append(epoch_rate(loader))
    ratios = [m / s for m, s in zip(rates["mixture"], rates["single"], strict=True)]
    stats = built["mixture"].stats()
    for loader in built.values():
        loader.close()
    rows = [[name, f"{median(r):,.0f}", spread(r)] for name, r in rates.items()]
    text = "\n".join([
        f"Two-source Mixture vs the single-dataset shuffle, {images.n} images, batch {BATCH}, "
        f"{WORKERS} process workers, DecodeCropFlip({SIZE}); {args.rounds} rounds",
        f"machine: {machine()}; load: {load_average()}; pid {os.getpid()}",
        table(["loader", "samples/s (median)", "range"], rows),
        f"mixture / single: {median(ratios):.3f} (median of per-round ratios; range {spread(ratios)})",
        f"mixture's per-source summary: {stats.get('sources')}",
    ])
    emit(text, {"rates": rates, "ratios": ratios, "n": images.n}, args.json)


if __name__ == "__main__":
    main()
