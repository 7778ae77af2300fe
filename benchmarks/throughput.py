"""Loader throughput against peers on the standard image augmentation.

The same ~20k JPEGs (128-256 px, `benchmarks/_images.py`, cached under benchmarks/out/) are
decoded, random-resized-cropped to 112 px and horizontally flipped, in batches of 64, with 2
workers, by:

* shardloader `Loader` over local Arrow shards, with process workers and with thread workers,
  using the fused `DecodeCropFlip` (antialiased, the default), `DecodeCropFlip(antialias=False)`
  (the fastest path in `shardloader.transforms`) and the PIL transform below as a plain
  function (what a user brings; the Loader seeds the global RNGs for it per sample);
* torch `DataLoader` over the individual files (a map-style dataset reading each file), with a
  PIL transform as users typically write it (torchvision's RandomResizedCrop semantics, PIL's
  antialiased bilinear resize, torch's global RNG) and with our `DecodeCropFlip`, which separates
  loader overhead from decode cost;
* webdataset `WebLoader` over tar shards (shard shuffle, a 1000-sample shuffle buffer), with the
  same two transforms;
* the limit: the transform alone in a plain loop in this process (samples per CPU second, one
  thread), times the number of cores.

Method. Every loader is built once and kept (persistent workers). One warm-up epoch, then
`--epochs` measured epochs; the configurations take turns epoch by epoch (rounds), and the limit
is measured again in every round, so that a burst of load from other processes hits all of them
alike. Figures are medians over rounds, with the min-max range; ratios to the limit and between
loaders are medians of per-round ratios. Time to first batch: a fresh loader (new worker pool,
files in the page cache) from construction to the first batch, median of `--ttfb-repeats`.

Reference figures from the issue (same work, this machine, 2 workers): FFCV 6,900 samples/s with
5-11 s to its first batch; PIL-based loaders 2,200-3,450 samples/s. Goal: above 6,900 samples/s,
first batch well under a second, at least 0.7 of the limit.

    .venv/bin/python -m benchmarks.throughput [--n 20000] [--epochs 3] [--only shardloader]
    .venv/bin/python -m benchmarks.throughput --fast-path [--n 6000] [--epochs 3]
        [--worker-types process thread] [--transforms fused fused-k-area fused-linear]

`--fast-path` measures only shardloader's own fast path against the stack's limit in the same
run (issue 14's figures: samples/s, CPU s per 1k samples over the process tree, fraction of the
limit with and without antialias, stall at 80% load); `fast_path()` / `report_fast_path()` are
the functions behind it, for a consolidated run.
"""

from __future__ import annotations

import argparse
import gc
import io
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

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
from benchmarks._images import ImageSet, describe, prepare_images

SIZE = 112
BATCH = 64
WORKERS = 2
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
FFCV_MARK = 6_900.0
GOAL_RATIO_TO_LIMIT = 0.7


# -- transforms --------------------------------------------------------------------------------


def pil_crop_flip(data: bytes) -> np.ndarray:
    """What a typical torchvision user does with PIL: decode, RandomResizedCrop (bilinear,
    antialiased), RandomHorizontalFlip, drawing from torch's global RNG. HWC uint8 out."""
    from PIL import Image

    from shardloader.transforms import sample_crop_box

    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB")
        top, left, h, w = sample_crop_box(img.height, img.width, SCALE, RATIO)
        out = img.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
    if torch.rand(()).item() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def fused(antialias: bool = True, method: str | None = None) -> Any:
    from shardloader.transforms import DecodeCropFlip

    extra = {} if method is None else {"antialias_method": method}
    return DecodeCropFlip(SIZE, SCALE, RATIO, antialias=antialias, **extra)


def make_transform(kind: str) -> Any:
    """The DecodeCropFlip of a `TRANSFORMS` kind (None for "pil")."""
    if kind == "pil":
        return None
    return fused(kind != "fused-linear", "k-area" if kind == "fused-k-area" else None)


class BytesTransform:
    """Adapts a sample-dict transform (or the PIL function) to `bytes -> HWC array`, for the
    peers' pipelines, which hand over raw bytes and draw from the global RNG."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.t = make_transform(kind)

    def __call__(self, data: bytes) -> np.ndarray:
        if self.t is None:
            return pil_crop_flip(data)
        return self.t({"image": data})["image"]


TRANSFORMS = {
    "fused": "DecodeCropFlip (antialiased, default: antialias_method='adaptive')",
    "fused-k-area": "DecodeCropFlip(antialias_method='k-area') (the antialias before 'adaptive')",
    "fused-linear": "DecodeCropFlip(antialias=False)",
    "pil": "PIL decode + resize (torchvision-style)",
}


# -- the limit ---------------------------------------------------------------------------------


def limit_rate(kind: str, blobs: list[bytes]) -> tuple[float, float]:
    """(samples per CPU second, samples per wall second) of `kind`'s transform in a plain loop
    in this process on one thread. The fused transforms get a generator seeded per sample (as
    an exact loader needs); the PIL one draws from torch's global RNG, as in a DataLoader."""
    import cv2

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    saved = torch.random.get_rng_state()
    g = torch.Generator()
    t = make_transform(kind)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if t is None:
        for data in blobs:
            pil_crop_flip(data)
    else:
        for i, data in enumerate(blobs):
            g.manual_seed(i)
            t({"image": data}, generator=g)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    torch.random.set_rng_state(saved)
    return len(blobs) / cpu, len(blobs) / wall


# -- loaders -----------------------------------------------------------------------------------


class FileDataset(torch.utils.data.Dataset):
    """Map-style dataset over image files: reads the file, transforms it (what most users have)."""

    def __init__(self, items: list[tuple[str, int]], transform: Callable[[bytes], np.ndarray]) -> None:
        self.items, self.transform = items, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        with open(path, "rb") as f:
            data = f.read()
        return torch.from_numpy(self.transform(data)), label


def _wds_sample(transform: Callable[[bytes], np.ndarray]) -> Callable[[tuple[bytes, bytes]], Any]:
    def decode(sample: tuple[bytes, bytes]) -> tuple[np.ndarray, int]:
        return transform(sample[0]), int(sample[1])
    return decode


@dataclass
class Config:
    """One loader under test: how to build it, how to count a batch's samples, how to close it."""

    name: str
    transform: str
    build: Callable[[], Any]
    count: Callable[[Any], int]
    close: Callable[[Any], None]
    group: str
    rates: list[float] = field(default_factory=list)
    cpu_per_sample: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    loader: Any = None
    expected: int = 0


def pil_sample_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """The PIL transform as a user would pass it to the Loader: a plain function drawing from
    torch's global RNG (the Loader seeds it per sample)."""
    return {"image": pil_crop_flip(sample["image"]), "label": sample["label"]}


def shardloader_config(images: ImageSet, worker_type: str, transform: str) -> Config:
    from shardloader import Dataset, Loader

    def build() -> Any:
        t = pil_sample_transform if transform == "pil" else make_transform(transform)
        return Loader(Dataset(images.arrow_dir), batch_size=BATCH, num_workers=WORKERS,
                      worker_type=worker_type, transform=t, seed=0, shuffle=True,
                      persistent_workers=True)

    return Config(f"shardloader Loader ({worker_type}es)" if worker_type == "process"
                  else f"shardloader Loader ({worker_type}s)", transform, build,
                  lambda b: int(b["image"].shape[0]), lambda loader: loader.close(), "shardloader")


class _Reiterable:
    """A DataLoader-like object plus the iterator of its current epoch (closed explicitly)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.iterator: Any = None

    def __iter__(self) -> Any:
        self.iterator = iter(self.loader)
        return self.iterator

    def close(self) -> None:
        it, self.iterator = self.iterator, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del it
        self.loader = None
        gc.collect()


def dataloader_config(images: ImageSet, transform: str) -> Config:
    def build() -> Any:
        ds = FileDataset(images.file_items(), BytesTransform(transform))
        return _Reiterable(torch.utils.data.DataLoader(
            ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS, persistent_workers=True))

    return Config("torch DataLoader (files)", transform, build, lambda b: int(b[0].shape[0]),
                  lambda r: r.close(), "torch")


def webdataset_config(images: ImageSet, transform: str) -> Config:
    import webdataset as wds

    urls = images.tar_urls()

    def build() -> Any:
        ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
              .shuffle(1000)
              .to_tuple("jpg", "cls")
              .map(_wds_sample(BytesTransform(transform)))
              .batched(BATCH, partial=True))
        return _Reiterable(wds.WebLoader(ds, batch_size=None, num_workers=WORKERS,
                                         persistent_workers=True))

    return Config("webdataset WebLoader (tars)", transform, build, lambda b: len(b[1]),
                  lambda r: r.close(), "webdataset")


def make_configs(images: ImageSet, only: Iterable[str] | None) -> list[Config]:
    configs = [
        shardloader_config(images, "process", "fused"),
        shardloader_config(images, "thread", "fused"),
        shardloader_config(images, "process", "fused-linear"),
        shardloader_config(images, "thread", "fused-linear"),
        shardloader_config(images, "process", "pil"),
        shardloader_config(images, "thread", "pil"),
        dataloader_config(images, "pil"),
        dataloader_config(images, "fused"),
    ]
    try:
        configs += [webdataset_config(images, "pil"), webdataset_config(images, "fused")]
    except ImportError:
        print("webdataset: not installed")
    if only:
        wanted = set(only)
        configs = [c for c in configs if c.group in wanted]
    return configs


# -- measuring ---------------------------------------------------------------------------------


def time_to_first_batch(config: Config) -> float:
    start = time.perf_counter()
    loader = config.build()
    it = iter(loader)
    batch = next(it)
    seconds = time.perf_counter() - start
    config.count(batch)
    del batch, it
    config.close(loader)
    return seconds


def run_epoch(config: Config) -> tuple[float, float]:
    """(samples/s, CPU seconds per sample of this process and all its children) over one full
    epoch of the (persistent) loader."""
    samples = 0
    cpu0 = tree_cpu_seconds()
    start = time.perf_counter()
    for batch in config.loader:
        samples += config.count(batch)
    seconds = time.perf_counter() - start
    cpu = cpu_used(cpu0, tree_cpu_seconds())
    if samples < 0.9 * config.expected:
        raise RuntimeError(f"{config.name}: an epoch gave only {samples} samples")
    return samples / seconds, cpu / samples


def _parallel_limit(args: tuple[str, list[bytes]]) -> tuple[float, float]:
    return limit_rate(*args)


def run(n: int, epochs: int, ttfb_repeats: int, only: list[str] | None, limit_samples: int,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    images = prepare_images(n, log=log)
    configs = make_configs(images, only)
    kinds = sorted({c.transform for c in configs} | {"fused"}, key=list(TRANSFORMS).index)
    blobs = [images.read_jpeg(i) for i in range(min(limit_samples, n))]
    cores = os.cpu_count() or 1
    limits: dict[str, list[float]] = {k: [] for k in kinds}
    parallel: dict[str, list[float]] = {k: [] for k in kinds}
    loads = [load_average()]

    for kind in kinds:  # warm up imports and caches
        limit_rate(kind, blobs[:100])
    pool = multiprocessing.get_context("fork").Pool(cores)
    log(f"time to first batch ({ttfb_repeats} fresh loaders each) ...")
    for _ in range(ttfb_repeats):
        for c in configs:
            c.ttfb.append(time_to_first_batch(c))
    for c in configs:
        c.loader = c.build()
        c.expected = n
    for r in range(epochs + 1):
        round_limits = {}
        for kind in kinds:
            cpu_rate, _ = limit_rate(kind, blobs)
            round_limits[kind] = cpu_rate * cores
            together = pool.map(_parallel_limit, [(kind, blobs)] * cores)
            if r:  # round 0 is the warm-up
                limits[kind].append(cpu_rate * cores)
                parallel[kind].append(sum(wall for _, wall in together))
        rates = {}
        for c in configs:
            rates[c.name, c.transform], cpu_per_sample = run_epoch(c)
            if r:
                c.rates.append(rates[c.name, c.transform])
                c.cpu_per_sample.append(cpu_per_sample)
                c.ratios.append(rates[c.name, c.transform] / round_limits[c.transform])
        log(f"  round {r}{' (warm-up)' if r == 0 else ''}: "
            + ", ".join(f"{name}/{kind} {rate:,.0f}" for (name, kind), rate in rates.items()))
    for c in configs:
        c.close(c.loader)
        c.loader = None
    pool.close()
    pool.join()
    loads.append(load_average())
    return {
        "images": describe(images), "machine": machine(), "load": loads, "epochs": epochs,
        "limits": limits, "parallel_limits": parallel, "cores": cores,
        "configs": [{"name": c.name, "transform": c.transform, "group": c.group, "rates": c.rates,
                     "cpu_per_sample": c.cpu_per_sample, "ratios_to_limit": c.ratios,
                     "ttfb": c.ttfb} for c in configs],
    }


# -- the fast path alone (issue 14): samples/s, CPU per sample, fraction of the stack's limit ----

ISSUE_FFCV_RATE = 5_313.0  # FFCV on this work, 2 workers (issue 14); peers.py measures it live
ISSUE_FFCV_CPU_S_PER_1K = 0.36
FAST_GOAL_RATIO_TO_LIMIT = 0.85
FAST_GOAL_STALL = 0.02
LIMIT_KINDS = ("fused", "fused-k-area", "fused-linear")


def measure_stall(loader: Any, rate: float, batches: int, work_factor: float = 1.25) -> dict[str, float]:
    """A consumer that works (sleeps) `work_factor` x the loader's per-batch time (at 1.25:
    80% of its capacity) for `batches` batches: the fraction of wall time spent in next(), and
    next()'s median (the training thread's own work per batch when the batch is ready)."""
    work = work_factor * BATCH / rate
    it = iter(loader)
    for _ in range(3):  # the pipeline fills
        next(it)
    waits = []
    start = time.perf_counter()
    for _ in range(batches):
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t0)
        time.sleep(work)
    wall = time.perf_counter() - start
    del it
    return {"stall": sum(waits) / wall, "next_median_ms": 1e3 * median(waits),
            "next_max_ms": 1e3 * max(waits), "batches": len(waits)}


def fast_path(n: int = 20_000, rounds: int = 3, worker_types: Iterable[str] = ("process", "thread"),
              transforms: Iterable[str] = ("fused",), limit_samples: int = 2000,
              stall_batches: int = 150, limit_kinds: Iterable[str] = LIMIT_KINDS,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """shardloader's own fast path on the standard work, measured against the stack's limit in
    the same run: for each round, the plain-loop limit of every `LIMIT_KINDS` transform (one
    core, times the cores), then one epoch of each (worker type, transform) Loader (persistent
    workers, built once). Then a stall test of each Loader (after the rounds, one at a time).

    Returns per configuration the per-round samples/s, CPU seconds per 1k samples (this
    process and all its children: training process + workers), ratio to the round's limit of
    the same transform; the limits; and the stall. For `benchmarks/peers.py` or `run_all`:
    `report_fast_path(fast_path(...))` gives the table."""
    images = prepare_images(n, log=log)
    cores = os.cpu_count() or 1
    blobs = [images.read_jpeg(i) for i in range(min(limit_samples, n))]
    kinds = list(dict.fromkeys([*limit_kinds, *transforms]))
    for kind in kinds:
        limit_rate(kind, blobs[:100])  # imports, OpenCV init
    configs = [shardloader_config(images, wt, kind) for wt in worker_types for kind in transforms]
    loads = [load_average()]
    limits: dict[str, list[float]] = {k: [] for k in kinds}
    for c in configs:
        c.loader = c.build()
        c.expected = n
        run_epoch(c)  # warm-up epoch: workers started, pages cached
    for r in range(rounds):
        round_limits = {}
        for kind in kinds:
            round_limits[kind] = limit_rate(kind, blobs)[0] * cores
            limits[kind].append(round_limits[kind])
        for c in configs:
            rate, cpu_per_sample = run_epoch(c)
            c.rates.append(rate)
            c.cpu_per_sample.append(cpu_per_sample)
            c.ratios.append(rate / round_limits[c.transform])
        log(f"  round {r}: limits " + ", ".join(f"{k} {v:,.0f}" for k, v in round_limits.items())
            + "; " + ", ".join(f"{c.name}/{c.transform} {c.rates[-1]:,.0f}" for c in configs))
    stalls = {}
    for c in configs:
        stalls[c.name, c.transform] = measure_stall(c.loader, median(c.rates), stall_batches)
        c.close(c.loader)
        c.loader = None
    loads.append(load_average())
    return {
        "images": describe(images), "machine": machine(), "load": loads, "rounds": rounds,
        "cores": cores, "limits": limits,
        "configs": [{"name": c.name, "transform": c.transform, "rates": c.rates,
                     "cpu_s_per_1k": [1e3 * x for x in c.cpu_per_sample],
                     "ratios_to_limit": c.ratios, **stalls[c.name, c.transform]}
                    for c in configs],
    }


def report_fast_path(results: dict[str, Any]) -> str:
    cores = results["cores"]
    lines = [
        f"# shardloader fast path: decode + RandomResizedCrop({SIZE}) + flip, batch {BATCH}, "
        f"{WORKERS} workers",
        f"{results['images']}; {results['machine']}",
        f"{results['load'][0]} before, {results['load'][1]} after; medians of "
        f"{results['rounds']} rounds (limits and loaders interleaved per round)",
        "",
    ]
    rows = []
    for kind, values in results["limits"].items():
        rows.append([f"limit: plain loop, 1 core x {cores}", kind, median(values), spread(values),
                     cores / median(values) * 1e3, 1.0, 1.0, "-", "-", "-"])
    for c in results["configs"]:
        limit_cpu = cores / median(results["limits"][c["transform"]]) * 1e3
        rows.append([c["name"], c["transform"], median(c["rates"]), spread(c["rates"]),
                     median(c["cpu_s_per_1k"]), median(c["ratios_to_limit"]),
                     limit_cpu / median(c["cpu_s_per_1k"]),
                     median(c["rates"]) / ISSUE_FFCV_RATE, f"{c['stall']:.1%}",
                     c["next_median_ms"]])
    lines.append(table(["loader", "transform", "samples/s", "range", "CPU s / 1k samples",
                        "x limit", "CPU efficiency", "x FFCV (issue: 5,313)", "stall at 80%",
                        "next() median ms"], rows))
    lines.append("")
    lines.append(
        "limit = samples per CPU second of the transform in a plain loop on one core x cores, "
        "measured every round; CPU s / 1k = CPU time of the training process and its workers "
        f"per 1,000 delivered samples (FFCV in the issue: {ISSUE_FFCV_CPU_S_PER_1K}); CPU "
        "efficiency = the plain loop's CPU per sample / the loader's: what x limit reaches on a "
        "machine nobody else loads (samples/s moves with other processes' load, this hardly); "
        "stall = "
        "time in next() / wall time with a consumer sleeping 1.25x the loader's per-batch time. "
        "Transforms: " + "; ".join(f"{k} = {TRANSFORMS[k]}" for k in results["limits"]) + ".")
    best = max(results["configs"], key=lambda c: median(c["rates"]), default=None)
    if best is not None:
        ratio = median(best["ratios_to_limit"])
        cpu = median(best["cpu_s_per_1k"])
        lines.append("")
        lines.append(
            f"Goals (best: {best['name']} / {best['transform']}): {median(best['rates']):,.0f} "
            f"samples/s = {median(best['rates']) / ISSUE_FFCV_RATE:.2f}x the issue's FFCV "
            f"(goal 1.2); CPU {cpu:.3f} s/1k (goal <= FFCV's, issue {ISSUE_FFCV_CPU_S_PER_1K}); "
            f"{ratio:.2f} of the limit (goal {FAST_GOAL_RATIO_TO_LIMIT}); stall "
            f"{best['stall']:.1%} (goal <= {FAST_GOAL_STALL:.0%}).")
    return "\n".join(lines)


# -- reporting ---------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    lines = [
        f"# Loader throughput: decode + RandomResizedCrop({SIZE}) + flip, batch {BATCH}, "
        f"{WORKERS} workers",
        f"{results['images']}; {results['machine']}",
        f"{results['load'][0]} before, {results['load'][1]} after; medians of "
        f"{results['epochs']} epochs after a warm-up epoch (configurations interleaved per epoch)",
        "",
    ]
    rows = []
    cpu_limit = {}
    for kind, values in results["limits"].items():
        cpu_limit[kind] = results["cores"] / median(values)  # CPU s per sample, plain loop
        rows.append([f"limit: plain loop x {results['cores']} cores", kind, median(values),
                     spread(values), "-", 1.0, 1e6 * cpu_limit[kind], 1.0,
                     median(values) / FFCV_MARK])
    for kind, values in results["parallel_limits"].items():
        rows.append([f"plain loop in {results['cores']} processes at once", kind, median(values),
                     spread(values), "-", median(values) / median(results["limits"][kind]), "-",
                     "-", median(values) / FFCV_MARK])
    by_name = {}
    for c in results["configs"]:
        rate = median(c["rates"])
        by_name[(c["name"], c["transform"])] = c
        cpu = median(c["cpu_per_sample"])
        rows.append([c["name"], c["transform"], rate, spread(c["rates"]), median(c["ttfb"]),
                     median(c["ratios_to_limit"]), 1e6 * cpu, cpu_limit[c["transform"]] / cpu,
                     rate / FFCV_MARK])
    lines.append(table(["loader", "transform", "samples/s", "range", "first batch s",
                        "x limit", "CPU us/sample", "CPU efficiency", "x FFCV 6,900"], rows))
    lines.append("")
    lines.append("Transforms: " + "; ".join(f"{k} = {v}" for k, v in TRANSFORMS.items()) + ".")
    lines.append(
        "limit = samples per CPU second of the transform in a plain loop in one process x cores "
        "(measured every round); x limit = median of per-round ratios. CPU us/sample = CPU time "
        "of this process and all its children per delivered sample; CPU efficiency = the plain "
        "loop's CPU per sample / the loader's (1.0 = no overhead): unlike samples/s it hardly "
        "moves with load from other processes, and a quiet machine's x limit approaches it.")
    ours = [c for c in results["configs"] if c["group"] == "shardloader"]
    peers = [c for c in results["configs"] if c["group"] != "shardloader"]
    if ours and peers:
        lines.append("")
        lines.append("Ratios of shardloader to each peer (median of per-round ratios):")
        header = ["shardloader"] + [f"{p['name']} / {p['transform']}" for p in peers]
        ratio_rows = []
        for o in ours:
            row: list[object] = [f"{o['name']} / {o['transform']}"]
            for p in peers:
                row.append(median([a / b for a, b in zip(o["rates"], p["rates"])]))
            ratio_rows.append(row)
        lines.append(table(header, ratio_rows))
    if len(ours) >= 2:
        lines.append("")
        lines.append("Threads vs processes (same transform, median of per-round ratios):")
        rows = []
        for kind in TRANSFORMS:
            p = by_name.get(("shardloader Loader (processes)", kind))
            t = by_name.get(("shardloader Loader (threads)", kind))
            if p and t:
                rows.append([kind, median(p["rates"]), median(t["rates"]),
                             median([a / b for a, b in zip(t["rates"], p["rates"])]),
                             median(p["ttfb"]), median(t["ttfb"])])
        lines.append(table(["transform", "processes samples/s", "threads samples/s",
                            "threads / processes", "first batch s (processes)",
                            "first batch s (threads)"], rows))
    best = max((c for c in ours if c["transform"] != "pil"), key=lambda c: median(c["rates"]),
               default=None)
    if best is not None:
        rate, ttfb, ratio = median(best["rates"]), median(best["ttfb"]), median(best["ratios_to_limit"])
        lines.append("")
        lines.append(
            f"Goal check (best shardloader: {best['name']} / {best['transform']}): "
            f"{rate:,.0f} samples/s {'>' if rate > FFCV_MARK else '<='} 6,900 (FFCV); first batch "
            f"{ttfb:.2f} s; {ratio:.2f} of the limit ({'meets' if ratio >= GOAL_RATIO_TO_LIMIT else 'below'} 0.7)."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="images (default 20000)")
    parser.add_argument("--epochs", type=int, default=3, help="measured epochs (default 3)")
    parser.add_argument("--ttfb-repeats", type=int, default=3)
    parser.add_argument("--limit-samples", type=int, default=2000,
                        help="samples per limit measurement (default 2000)")
    parser.add_argument("--only", nargs="*", choices=["shardloader", "torch", "webdataset"],
                        help="measure only these loader groups")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--fast-path", action="store_true",
                        help="only shardloader's fast path against the stack's limit, with CPU "
                             "per sample and the stall (issue 14's figures)")
    parser.add_argument("--worker-types", nargs="*", default=["process", "thread"])
    parser.add_argument("--transforms", nargs="*", default=["fused"], choices=list(TRANSFORMS))
    parser.add_argument("--limit-kinds", nargs="*", default=list(LIMIT_KINDS), choices=list(TRANSFORMS),
                        help="transforms whose plain-loop limit is measured (--fast-path)")
    parser.add_argument("--stall-batches", type=int, default=150)
    args = parser.parse_args(argv)
    if args.fast_path:
        results = fast_path(args.n, args.epochs, args.worker_types, args.transforms,
                            args.limit_samples, args.stall_batches, args.limit_kinds)
        emit(report_fast_path(results), results, args.json)
        return 0
    results = run(args.n, args.epochs, args.ttfb_repeats, args.only, args.limit_samples)
    emit(report(results), results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
