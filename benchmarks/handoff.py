"""The hand-off from worker to batch, for the README transform and for the user's own.

Issue 24: a user who wraps the built-in transforms in their own function got ~0.78 of the
README transform's samples/s, because only `Compose([DecodeCropFlip(112), ToTensor()])` had a
path that builds the batch in the worker's shared-memory slot. This benchmark measures, in one
run on the same JPEGs (`benchmarks/_images.py`, 128-256 px, the images of
`benchmarks/speed.py`; fewer of them by default), with batch 64 and 2 workers:

* (a) the README transform `Compose([DecodeCropFlip(112), ToTensor()])`,
* (b) the user's own function calling the same two transforms and returning
  ``{"img": t, "label": l}`` (it takes the sample's `generator`, as the docs advise),
* (b1) the same function declaring `uses_global_rng = False` (without it, the Loader seeds
  torch's global generator per sample, and `random` and `numpy` only once it has seen the
  function draw from them: `shardloader.order.global_rngs`; before that lazy seeding every
  sample paid 26-33 us for all three),
* (b0) the same function without a `generator` parameter (the Loader then seeds torch's
  global generator per sample, and the transforms draw from it),
* (c) a user function that also adds a field: a float tensor of shape (3,).

Every loader is built once (persistent workers) and runs one first epoch; then the loaders
take turns epoch by epoch (`--rounds` epochs each), so that load from other processes hits
them alike. samples/s counts after each epoch's first 5 batches; the figure is the median over
rounds, and the ratios to (a) are medians of per-round ratios. Beside it, the CPU seconds the
process tree (training process and every worker) used per sample in each epoch (median), and
the ratio of (a)'s to each one's: what samples/s would be on cores nobody else loads, hardly
moved by other load (the 2-core machine this was written on is shared).

    .venv/bin/python -m benchmarks.handoff            # 6,000 images, 5 rounds
    .venv/bin/python -m benchmarks.handoff --quick    # 3,000 images, 3 rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import cpu_used, load_average, machine, tree_cpu_seconds
from benchmarks._images import prepare_images
from shardloader import Dataset, Loader
from shardloader.transforms import Compose, DecodeCropFlip, ToTensor

SIZE = 112
BATCH = 64
WORKERS = 2
SEED = 0
WARMUP_BATCHES = 5

_CROP = DecodeCropFlip(SIZE)
_TO_TENSOR = ToTensor()


def user_transform(sample: dict[str, Any], generator: torch.Generator | None = None) -> dict[str, Any]:
    """(b) The user's own function over the built-in transforms."""
    image = _TO_TENSOR(_CROP(sample, generator=generator))["image"]
    return {"img": image, "label": sample["label"]}


def user_transform_globals(sample: dict[str, Any]) -> dict[str, Any]:
    """(b0) The same without a `generator` parameter: the transforms draw from the global RNGs
    (which the Loader seeds per sample)."""
    image = _TO_TENSOR(_CROP(sample))["image"]
    return {"img": image, "label": sample["label"]}


def user_transform_declared(sample: dict[str, Any], generator: torch.Generator | None = None) -> dict[str, Any]:
    """(b1) The same as (b), declaring that it draws from no global RNG (`uses_global_rng`), so
    the Loader does not seed them per sample (docs/concepts.md)."""
    image = _TO_TENSOR(_CROP(sample, generator=generator))["image"]
    return {"img": image, "label": sample["label"]}


user_transform_declared.uses_global_rng = False  # type: ignore[attr-defined]


def user_transform_extra(sample: dict[str, Any], generator: torch.Generator | None = None) -> dict[str, Any]:
    """(c) The user's own function adding a field: a float tensor of shape (3,)."""
    image = _TO_TENSOR(_CROP(sample, generator=generator))["image"]
    mean = image.view(3, -1).float().mean(dim=1)
    return {"img": image, "label": sample["label"], "mean": mean}


CASES: dict[str, tuple[str, Callable[[], Any]]] = {
    "a": ("README: Compose([DecodeCropFlip(112), ToTensor()])",
          lambda: Compose([DecodeCropFlip(SIZE), ToTensor()])),
    "b": ("user's function -> {img, label}", lambda: user_transform),
    "b1": ("(b), declaring uses_global_rng = False", lambda: user_transform_declared),
    "b0": ("user's function, no generator (global RNGs)", lambda: user_transform_globals),
    "c": ("user's function -> {img, label, mean: float (3,)}", lambda: user_transform_extra),
}


def epoch_rate(loader: Loader) -> float:
    """Samples/s of one epoch of a warm loader, after its first WARMUP_BATCHES batches."""
    count, start = 0, time.perf_counter()
    for i, batch in enumerate(loader):
        if i == WARMUP_BATCHES:
            start, count = time.perf_counter(), 0
        count += len(batch["__index__"])
    return count / (time.perf_counter() - start)


def run(n: int, rounds: int, cases: list[str], log: Callable[[str], None] = print) -> dict[str, Any]:
    images = prepare_images(n, log=log)
    loaders = {}
    for case in cases:
        loaders[case] = Loader(Dataset(images.arrow_dir), batch_size=BATCH, num_workers=WORKERS,
                               transform=CASES[case][1](), seed=SEED, tail="partial", shuffle=True,
                               persistent_workers=True)
        epoch_rate(loaders[case])  # worker start, first reads, page cache
    rates: dict[str, list[float]] = {case: [] for case in cases}
    cpu: dict[str, list[float]] = {case: [] for case in cases}
    try:
        for r in range(rounds):
            for case in cases:
                before = tree_cpu_seconds()
                rates[case].append(epoch_rate(loaders[case]))
                cpu[case].append(cpu_used(before, tree_cpu_seconds()) / n)
            log(f"  round {r + 1}: " + ", ".join(f"({c}) {rates[c][-1]:,.0f}/s" for c in cases))
    finally:
        for loader in loaders.values():
            loader.close()
    return {"n": n, "rounds": rounds, "rates": rates, "cpu": cpu}


def report(results: dict[str, Any]) -> str:
    rates, cpu = results["rates"], results["cpu"]
    lines = [f"hand-off benchmark: {results['n']} JPEGs 128-256 px -> {SIZE} px, batch {BATCH}, "
             f"{WORKERS} workers, {results['rounds']} epochs each, alternated; {machine()}, "
             f"{load_average()}",
             f"{'case':<4} {'transform':<52} {'samples/s':>10} {'vs (a)':>7} {'CPU us/sample':>14} "
             f"{'vs (a)':>7}  samples/s per epoch"]
    for case, values in rates.items():
        ratio = cpu_ratio = ""
        if case != "a" and "a" in rates:
            ratio = f"{statistics.median(v / a for v, a in zip(values, rates['a'])):.3f}"
            cpu_ratio = f"{statistics.median(a / v for v, a in zip(cpu[case], cpu['a'])):.3f}"
        lines.append(f"({case:<2}) {CASES[case][0]:<52} {statistics.median(values):>10,.0f} "
                     f"{ratio:>7} {statistics.median(cpu[case]) * 1e6:>14,.1f} {cpu_ratio:>7}  "
                     + " ".join(f"{v:,.0f}" for v in values))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=6_000, help="images (default 6,000)")
    parser.add_argument("--rounds", type=int, default=5, help="epochs per loader (>= 3)")
    parser.add_argument("--cases", default="a,b,b1,b0,c", help="which loaders, comma-separated")
    parser.add_argument("--quick", action="store_true", help="3,000 images, 3 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.rounds = 3_000, 3
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    print(report(run(args.n, max(3, args.rounds), cases)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
