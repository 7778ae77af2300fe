"""Remote shards through the node cache: cold vs warm epochs, and sharing one cache.

Setup. A dataset of Arrow shards (`--shards` x `--shard-mb`, random payloads of `--sample-kb`)
is uploaded to an S3 server (moto in server mode) that runs in a separate process behind the
fault proxy of tests/fixtures/servers.py, which adds `--latency` seconds to every request and
caps the bandwidth shared by all connections at `--bandwidth-mb` MB/s. A training loop reads it
with the Loader (`--workers` worker processes, batches of `--batch`) and spends `--step-ms` per
batch on its "step" (a sleep, as when the accelerator computes), so the loop consumes
batch * sample / step bytes per second; the bandwidth cap is set above that rate (the script
prints both), as the issue asks.

Measured, each `--repeats` times with a fresh cache (medians, min-max):

1. cold: first epoch with an empty cache and background prefetch (the default);
2. warm: the next epoch from a fresh Loader on the same, now full, cache;
3. cold without prefetch (readers fetch on demand), to show what prefetch buys.

For each: samples/s over the whole epoch (time to first batch included) and from the first
batch on, time to first batch (from `Dataset(url)` to the first batch), and bytes downloaded
per epoch per node as counted by the proxy, relative to the dataset's size. Goal: cold/warm
throughput >= 0.9.

`--first-batch` measures only the cold first batch, whole shards (range reads off: before)
against rows read by byte range (after), alternated, from `Loader(...)` and from `Dataset(url)`;
`cold_first_batch` is the function to call from other benchmarks.

`--cold-start` measures the cold first batch exactly as `benchmarks.speed` does (its image set,
moto on loopback without a proxy, a fresh process and an empty cache per try, 2 workers), with
the read path's own S3 client and with s3fs (`SHARDLOADER_S3_CLIENT=fsspec`), alternated.

4. Four processes on one node share one cache that holds the dataset: (a) the 4 ranks of one
job (world size 4), (b) 4 independent jobs each reading the whole dataset. Bytes downloaded in
total / dataset size; goal 1.0 (every shard downloaded once per node).

    .venv/bin/python -m benchmarks.cache [--repeats 3] [--shards 64] [--latency 0.03]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import torch

from benchmarks._common import load_average, machine, median, spread, table

# -- the S3 server + proxy, in their own process ----------------------------------------------


def _serve(conn: Any, data_dir: str, latency: float, bandwidth: float) -> None:
    from tests.fixtures.servers import FaultProxy, S3Server

    s3 = S3Server().start()
    url = s3.upload_dir(data_dir, s3.create_bucket("bench"), "ds")
    proxy = FaultProxy(s3.endpoint, latency=latency, bandwidth=bandwidth)
    conn.send({"url": url, "options": s3.storage_options(proxy.url, timeout=120)})
    while True:
        message = conn.recv()
        if message == "stats":
            conn.send({"requests": len(proxy.log), "bytes": proxy.bytes_sent})
        elif message == "stop":
            break
    proxy.stop()
    s3.stop()


class Remote:
    def __init__(self, data_dir: str, latency: float, bandwidth: float) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, data_dir, latency, bandwidth), daemon=True)
        self._proc.start()
        info = self._conn.recv()
        self.url, self.options = info["url"], info["options"]

    def bytes_sent(self) -> int:
        self._conn.send("stats")
        return int(self._conn.recv()["bytes"])

    def stop(self) -> None:
        self._conn.send("stop")
        self._proc.join(30)


# -- the training loop -----------------------------------------------------------------------


def to_tensor(record: dict) -> dict:
    """A cheap transform: the payload's first bytes as a tensor (the decode is not measured)."""
    return {"x": torch.frombuffer(bytearray(record["data"][:64]), dtype=torch.uint8)}


def epoch(url: str, options: dict, cache: str, *, prefetch: bool, args: argparse.Namespace,
          rank: int = 0, world: int = 1) -> dict[str, float]:
    from shardloader import Dataset, Loader

    start = time.perf_counter()
    ds = Dataset(url, cache_dir=cache, cache_limit=args.cache_limit, storage_options=options)
    ds.source.prefetch = prefetch
    loader = Loader(ds, batch_size=args.batch, seed=0, num_workers=args.workers, transform=to_tensor,
                    rank=rank, world_size=world, shuffle=True, persistent_workers=args.workers > 0)
    first = None
    samples = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter()
        samples += int(batch["__index__"].numel())
        time.sleep(args.step_ms / 1000)  # the training step
    end = time.perf_counter()
    loader.close()
    counters = ds.source.counters()
    ds.close()
    assert first is not None
    return {
        "samples": samples,
        "whole": samples / (end - start),
        "steady": samples / (end - first),
        "ttfb": first - start,
        "seconds": end - start,
        "prefetched": counters["prefetched"],
    }


def cold_first_batch(url: str, options: dict, cache: str, *, range_reads: bool,
                     args: argparse.Namespace) -> dict[str, float]:
    """Seconds to the first batch with an empty cache: from `Dataset(url)` (index download
    included) and from `Loader(...)`; `range_reads=False` is the whole-shard path (before)."""
    from shardloader import Dataset, Loader

    start = time.perf_counter()
    remote = "://" in url
    ds = Dataset(url, cache_dir=cache if remote else None, cache_limit=args.cache_limit if remote else None,
                 storage_options=options if remote else None)
    if remote:
        ds.source.range_reads = range_reads
    built = time.perf_counter()
    loader = Loader(ds, batch_size=args.batch, seed=0, num_workers=args.workers, transform=to_tensor,
                    shuffle=True)
    batch = next(iter(loader))
    end = time.perf_counter()
    assert int(batch["__index__"].numel()) == args.batch
    loader.close()
    ds.close()
    return {"from_dataset": end - start, "from_loader": end - built}


def first_batch_table(remote: Remote, work: str, args: argparse.Namespace) -> str:
    """Cold first batch, whole shards (before) vs reads by range (after), alternated A/B/C with
    the same loader over the local copy (the floor: worker start, decode, collate)."""
    runs: dict[str, list[dict[str, float]]] = {"whole": [], "range": [], "local": []}
    for r in range(args.repeats):
        for kind in runs:
            cache = os.path.join(work, f"first-{r}-{kind}")
            url = remote.url if kind != "local" else os.path.join(work, "ds")
            result = cold_first_batch(url, remote.options, cache, range_reads=kind == "range", args=args)
            runs[kind].append(result)
            shutil.rmtree(cache, ignore_errors=True)
    rows = []
    names = {"whole": "cold S3, whole shards (before)", "range": "cold S3, rows by byte range (after)",
             "local": "local shards (the floor)"}
    for kind, name in names.items():
        results = runs[kind]
        rows.append([name, median([x["from_loader"] for x in results]),
                     spread([x["from_loader"] for x in results]),
                     median([x["from_dataset"] for x in results])])
    ratio = median([a["from_loader"] / b["from_loader"] for a, b in zip(runs["whole"], runs["range"])])
    over = median([a["from_loader"] - b["from_loader"] for a, b in zip(runs["range"], runs["local"])])
    return (table(["first batch", "from Loader() (s)", "range", "from Dataset() (s)"], rows)
            + f"\nwhole / by range: {ratio:.2f}x; by range - local: {over:.2f} s "
              "(goal: <= 0.4 s from Loader())")


def cold_start_table(repeats: int, n: int) -> str:
    """speed.py's cold first batch (fresh processes), our S3 client vs s3fs, alternated."""
    import statistics

    from benchmarks._images import prepare_images
    from benchmarks._s3 import S3Process
    from benchmarks.speed import OURS, run_child

    images = prepare_images(n, log=print)
    variants = {"shardloader (botocore S3 reader)": {}, "shardloader (s3fs)": {"SHARDLOADER_S3_CLIENT": "fsspec"}}
    got: dict[str, list[float]] = {name: [] for name in variants}
    with S3Process({"arrow": images.arrow_dir}) as server:
        for _ in range(repeats):
            for name, env in variants.items():
                cache = tempfile.mkdtemp(prefix="cold-", dir=os.path.join(os.path.dirname(__file__), "out"))
                try:
                    out = run_child({"column": OURS, "n": n, "endpoint": server.at.endpoint,
                                     "cache_dir": cache}, env={**server.at.env(), **env}, timeout=300)
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
                got[name].append(out["ttfb"])
    rows = [[name, statistics.median(v), spread(v)] for name, v in got.items()]
    return (f"cold first batch from S3 (moto, loopback), {n} images, {repeats} fresh processes each, "
            f"alternated; {load_average()}\n\n" + table(["loader", "first batch (s)", "range"], rows)
            + "\ngoal: <= 0.4 s")


def _job(url: str, options: dict, cache: str, args: argparse.Namespace, rank: int, world: int,
         barrier: Any, out: Any) -> None:
    barrier.wait()
    out.put(epoch(url, options, cache, prefetch=True, args=args, rank=rank, world=world))


def shared_node(remote: Remote, cache: str, args: argparse.Namespace, world: int) -> tuple[int, float]:
    """4 processes on one fresh cache; returns (bytes downloaded, wall seconds)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    before = remote.bytes_sent()
    start = time.perf_counter()
    procs = [ctx.Process(target=_job, args=(remote.url, remote.options, cache, args,
                                            r if world == 4 else 0, world, barrier, out))
             for r in range(4)]
    for p in procs:
        p.start()
    for _ in procs:
        out.get(timeout=600)
    for p in procs:
        p.join(60)
    return remote.bytes_sent() - before, time.perf_counter() - start


# -- main ------------------------------------------------------------------------------------


def make_dataset(path: str, args: argparse.Namespace) -> int:
    from shardloader.ingest.writer import write_shards

    per_shard = max(1, int(args.shard_mb * 1e6 / (args.sample_kb * 1e3)))
    rng = np.random.default_rng(0)
    samples = ({"data": rng.bytes(int(args.sample_kb * 1e3)), "label": i}
               for i in range(per_shard * args.shards))
    index = write_shards(samples, path, shard_samples=per_shard)
    return index.total_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--shard-mb", type=float, default=2.0)
    parser.add_argument("--sample-kb", type=float, default=8.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--bandwidth-mb", type=float, default=25.0)
    parser.add_argument("--cache-limit", default="1GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-shared", action="store_true")
    parser.add_argument("--first-batch", action="store_true",
                        help="only the cold first batch: whole shards vs reads by byte range")
    parser.add_argument("--cold-start", action="store_true",
                        help="only speed.py's cold first batch: our S3 client vs s3fs, alternated")
    parser.add_argument("--images", type=int, default=20_000, help="image set for --cold-start")
    args = parser.parse_args()
    if args.cold_start:
        print(cold_start_table(args.repeats, args.images))
        return

    work = tempfile.mkdtemp(prefix="shardloader-bench-cache-")
    try:
        data_dir = os.path.join(work, "ds")
        dataset_bytes = make_dataset(data_dir, args)
        consumption = args.batch * args.sample_kb * 1e3 / (args.step_ms / 1000)
        remote = Remote(data_dir, args.latency, args.bandwidth_mb * 1e6)
        print(f"# Remote shards through the node cache\n\n{machine()}; {load_average()}")
        print(f"dataset {args.shards} shards, {dataset_bytes / 1e6:.1f} MB; S3 (moto) behind a proxy "
              f"adding {args.latency * 1000:.0f} ms per request, capped at {args.bandwidth_mb:.0f} MB/s; "
              f"the loop consumes at most {consumption / 1e6:.1f} MB/s "
              f"({args.batch} x {args.sample_kb:.0f} kB per {args.step_ms:.0f} ms step), "
              f"{args.workers} workers\n")
        if args.first_batch:
            print(first_batch_table(remote, work, args))
            remote.stop()
            return
        runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": [], "cold, no prefetch": []}
        ratios_whole, ratios_steady = [], []
        for r in range(args.repeats):
            for prefetch, cold_name in ((True, "cold"), (False, "cold, no prefetch")):
                cache = os.path.join(work, f"cache-{r}-{prefetch}")
                before = remote.bytes_sent()
                cold = epoch(remote.url, remote.options, cache, prefetch=prefetch, args=args)
                cold["downloaded"] = (remote.bytes_sent() - before) / dataset_bytes
                runs[cold_name].append(cold)
                if prefetch:
                    before = remote.bytes_sent()
                    warm = epoch(remote.url, remote.options, cache, prefetch=True, args=args)
                    warm["downloaded"] = (remote.bytes_sent() - before) / dataset_bytes
                    runs["warm"].append(warm)
                    ratios_whole.append(cold["whole"] / warm["whole"])
                    ratios_steady.append(cold["steady"] / warm["steady"])
                shutil.rmtree(cache, ignore_errors=True)
        rows = []
        for name, results in runs.items():
            rows.append([
                name,
                median([x["whole"] for x in results]), spread([x["whole"] for x in results]),
                median([x["steady"] for x in results]),
                median([x["ttfb"] for x in results]), spread([x["ttfb"] for x in results]),
                median([x["downloaded"] for x in results]),
            ])
        print(table(["epoch", "samples/s", "range", "samples/s after 1st batch", "time to 1st batch (s)",
                     "range", "downloaded / dataset"], rows))
        limit = args.batch / (args.step_ms / 1000)
        print(f"\nloop limit (batch / step): {limit:,.0f} samples/s")
        print(f"cold / warm throughput: {median(ratios_whole):.3f} whole epoch "
              f"({spread(ratios_whole)}), {median(ratios_steady):.3f} after the first batch "
              f"({spread(ratios_steady)}); goal >= 0.9")
        if not args.skip_shared:
            rows = []
            for world, name in ((4, "4 ranks of one job"), (1, "4 jobs, each the whole dataset")):
                ratios, walls = [], []
                for r in range(args.repeats):
                    cache = os.path.join(work, f"shared-{world}-{r}")
                    downloaded, wall = shared_node(remote, cache, args, world)
                    ratios.append(downloaded / dataset_bytes)
                    walls.append(wall)
                    shutil.rmtree(cache, ignore_errors=True)
                rows.append([name, median(ratios), spread(ratios), median(walls)])
            print("\n4 processes, one node, one cache holding the dataset:\n")
            print(table(["processes", "downloaded / dataset", "range", "wall seconds"], rows))
            print("goal: 1.0 (each shard downloaded once per node)")
        remote.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
