"""The Arrow reader's memory and first batch: pyarrow against `format/ipc.py` and DataLoader (issue 37).

Local Arrow shards of ImageNet-sized JPEGs (`_images.imagenet_like_jpegs`: ~110 KB, 350-420
px; 2,000 of them in 8 shards) are read by shardloader's `Loader` (batch 64,
`DecodeCropFlip(224)`, shuffled, a 50 ms step per batch) at 1, 2, 4 and 8 workers, in three
ways, each run a fresh process that imports torch first:

* pyarrow: `ArrowShardReader` as it is (pyarrow's IPC reader; the training process loads
  pyarrow before the workers fork, so they share its pages);
* ipc (with `--ipc-src`, a source tree from before issue 37 removed it, e.g. `git archive
  8490461 src | tar -x -C /tmp/old`): `format/ipc.py` read the shards, no pyarrow in any
  process; the pyarrow way runs from that tree too then, with `ipc.parse_file` declining every
  file (the same comparison within one tree);
* dataloader: torch's DataLoader over the same JPEGs as files, the same transform: the
  per-worker growth the goal compares with.

After 8 batches the run samples its process tree's PSS (sum of /proc/<pid>/smaps_rollup Pss
over the training process and its workers) at each of the next 12 batches; the figure is the
median of those, and over rounds the median again. On a shared machine the tree's PSS moves
with other processes mapping the same libraries (another engineer's torch from the same
environment takes a share of its pages: 306-372 MiB for one configuration run three times),
so beside it `_measure.tree_footprint`: anonymous PSS plus each mapped file's pages once, what
the tree would take alone. Fixed cost and growth per worker are the
least-squares line through the 1-8 worker points; memory is not timing-sensitive, so 8 workers
on a 2-core machine still measure it. Beside it, construction to first batch (median).

    .venv/bin/python -m benchmarks.ipc_memory [--rounds 3] [--workers 1 2 4 8] [--ipc-src /tmp/old/src]

Measured on 2 cores shared with other engineers (load ~4), 3 rounds, `--workers 1 2 8
--ipc-src` (8490461): the tree alone at 1/2/8 workers, ipc 358/391/408 MiB, pyarrow 389/417/440,
DataLoader 340/363/489 (tree PSS: ipc 331/368/394, pyarrow 359/391/423, DataLoader
313/337/470). pyarrow is a fixed +26 to +32 MiB per tree, not a cost per worker. An earlier
single round at load 7.6 gave the same difference (+5 to +18 MiB of PSS) but steeper lines for
both readers (~34 MiB a worker): the growth depends on how far the workers run ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks._common import load_average, machine
from benchmarks._images import OUT, imagenet_like_jpegs
from benchmarks._measure import tree_footprint, tree_memory

N, SHARD = 2_000, 250
BATCH, SIZE, STEP_S, WARM, SAMPLED = 64, 224, 0.05, 8, 12
ROOT = os.path.join(OUT, "imagenet2k")
WAYS = ("ipc", "pyarrow", "dataloader")


def prepare() -> str:
    """The data set (made once): Arrow shards under ROOT/arrow, the same JPEGs under ROOT/files."""
    done = os.path.join(ROOT, "done")
    if not os.path.exists(done):
        from shardloader.ingest.writer import write_shards

        jpegs = imagenet_like_jpegs(N)
        os.makedirs(os.path.join(ROOT, "files"), exist_ok=True)
        for i, data in enumerate(jpegs):
            with open(os.path.join(ROOT, "files", f"{i:05d}.jpg"), "wb") as f:
                f.write(data)
        write_shards(({"image": b, "label": i % 10} for i, b in enumerate(jpegs)),
                     os.path.join(ROOT, "arrow"), shard_samples=SHARD, overwrite=True)
        open(done, "w").close()
    return ROOT


class _Files:
    """Map-style dataset over ROOT/files for DataLoader: the transformed image and its label."""

    def __init__(self) -> None:
        from shardloader.transforms import DecodeCropFlip

        self.paths = sorted(os.path.join(ROOT, "files", n) for n in os.listdir(os.path.join(ROOT, "files")))
        self.crop = DecodeCropFlip(SIZE)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):  # noqa: ANN204
        import torch

        with open(self.paths[i], "rb") as f:
            sample = self.crop({"image": f.read(), "label": i % 10})
        return torch.from_numpy(sample["image"]), i % 10


def child(way: str, workers: int) -> None:
    """One run: prints {"pss_mib", "first_batch_s"}."""
    import torch

    if way == "dataloader":
        start = time.perf_counter()
        loader = torch.utils.data.DataLoader(_Files(), batch_size=BATCH, shuffle=True, num_workers=workers,
                                             persistent_workers=True)
    else:
        import importlib.util

        from shardloader import Dataset, Loader
        from shardloader.transforms import DecodeCropFlip

        ipc = (importlib.import_module("shardloader.format.ipc")
               if importlib.util.find_spec("shardloader.format.ipc") else None)

        if way == "pyarrow" and ipc is not None:
            ipc.parse_file = lambda _mapped: None  # every shard through pyarrow's reader
        start = time.perf_counter()
        loader = Loader(Dataset(os.path.join(ROOT, "arrow")), batch_size=BATCH, num_workers=workers,
                        transform=DecodeCropFlip(SIZE), shuffle=True, persistent_workers=True)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    samples, footprints = [], []
    for i in range(WARM + SAMPLED):
        time.sleep(STEP_S)
        next(it)
        if i >= WARM:
            samples.append(tree_memory(os.getpid())["pss"])
            footprints.append(tree_footprint(os.getpid()))
    if way == "pyarrow":
        assert "pyarrow" in sys.modules
    elif way == "ipc":
        assert "pyarrow" not in sys.modules
    print(json.dumps({"pss_mib": statistics.median(samples) / 2**20,
                      "alone_mib": statistics.median(footprints) / 2**20, "first_batch_s": first}), flush=True)
    os._exit(0)  # the workers are daemons: no orderly shutdown to measure


def _fit(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (workers, MiB)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--ipc-src", help="a src/ tree that still has format/ipc.py: adds the ipc way")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    prepare()
    ways = WAYS if args.ipc_src else tuple(w for w in WAYS if w != "ipc")
    env = dict(os.environ)
    if args.ipc_src:  # shardloader from there, benchmarks from here
        env["PYTHONPATH"] = os.pathsep.join([args.ipc_src, os.getcwd()])
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for workers in args.workers:
            for way in (ways if r % 2 == 0 else ways[::-1]):
                out = subprocess.run([sys.executable, "-m", "benchmarks.ipc_memory", "--child", way, str(workers)],
                                     capture_output=True, text=True, timeout=600, check=True, env=env)
                runs.setdefault((way, workers), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{machine()}, load {load_average()}; {N} JPEGs ~110 KB, batch {BATCH}, {args.rounds} rounds")
    for key, what in (("pss_mib", "tree PSS"), ("alone_mib", "tree alone (anon PSS + files once)")):
        print(f" {what}; first batch")
        pss = {w: {n: statistics.median(x[key] for x in runs[(w, n)]) for n in args.workers} for w in ways}
        for way in ways:
            first = {n: statistics.median(x["first_batch_s"] for x in runs[(way, n)]) for n in args.workers}
            fixed, growth = _fit(pss[way])
            cells = "  ".join(f"{n}w {pss[way][n]:6.1f} MiB/{first[n] * 1e3:4.0f} ms" for n in args.workers)
            print(f"  {way:10s} {cells}  | line: {fixed:6.1f} MiB + {growth:5.2f} MiB/worker")
        for n in (args.workers if "ipc" in ways else []):
            print(f"  pyarrow - ipc at {n} workers: {pss['pyarrow'][n] - pss['ipc'][n]:+.1f} MiB")


if __name__ == "__main__":
    main()
