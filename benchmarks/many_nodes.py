"""Many nodes reading one dataset at once: N simulated nodes on this machine against one bucket on
loopback S3 (moto), through a proxy that answers ``503 SlowDown`` above a request rate per prefix
(`benchmarks._slowdown`: S3's documented 5,500 GET/s per prefix, scaled down to what this
machine can reach, 200/s by default).

A node is a process (a process group of its own) with its own cache directory and `--ranks` ranks
(the node process is rank 0 of its node and forks the others); every rank makes its own
`Dataset` and `Loader(rank=, world_size=N * ranks, num_workers=0)` and reads one epoch. All
ranks of all nodes are forked from this process after the imports and start together on one
event, so the cold first batch is measured from a common start. Each node's botocore user agent
carries ``node/<i>``, so the proxy's log says which node sent each request.

What is measured, per N (1, 4, 16, 64 by default), from the proxy's log:

* requests per object: successful whole-shard GETs per (shard, node), which must be 1 for every
  shard a node read and 0 for the others (each shard downloaded once per node, whatever its
  ranks); GETs of part of a shard (reads by range from a cold cache, before the shard is
  whole in the cache) are counted apart, as are the index and the range sidecars;
* the peak request rate: the most requests that arrived at one prefix in any one second
  (all of them, 503s included: what the clients offered), and of those served, against the
  limit;
* the 503s met, and how many requests the clients made in total;
* bytes per node: response body bytes the proxy sent to that node (mean and max), against the
  node's share of the dataset (dataset bytes x ranks on the node / world size);
* the first batch: seconds from the common start to each rank's first batch (median and max).

What the simulation cannot show: on 2 cores, 64 nodes are 64 processes taking turns on the
CPUs, so their first batches measure the machine's queue more than the network; loopback has
no bandwidth limit or latency; and moto plus the proxy run in one Python process whose own
speed bounds the rate reached. The counts (requests per object, 503s, bytes) do not depend
on that; the times do.

    python -m benchmarks.many_nodes                      # N = 1, 4, 16, 64
    python -m benchmarks.many_nodes --nodes 1,4 --rate 50 --json out.json
    python -m benchmarks.many_nodes --rate 20 --burst 10 --prefixes 16   # shards under 16 prefixes
    python -m benchmarks.many_nodes --rate 20 --retry-mode standard      # without botocore's pacing
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from typing import Any

from benchmarks._common import load_average, machine, table
from benchmarks._slowdown import BUCKET, SlowDownServer, prefix_of

PARTITIONS = 64  # a multiple of every world size measured (2 ... 128)
BATCH = 4  # per rank


def make_dataset(folder: str, samples: int, shard_samples: int, prefixes: int) -> Any:
    from shardloader.ingest.writer import write_shards
    from shardloader.synthetic import make_image_samples

    index = write_shards(make_image_samples(samples, min_size=16, max_size=24, seed=3), folder,
                         shard_samples=shard_samples, shard_table="json")
    return spread_over_prefixes(folder, prefixes) if prefixes > 1 else index


def spread_over_prefixes(folder: str, prefixes: int) -> Any:
    """Move each shard of the dataset in `folder` (and its sidecars) under one of `prefixes`
    hashed folders (``3f/shard-00017.arrow``) and rewrite `index.json` to match: the recipe of
    docs/distributed.md, "Laying a large dataset out across prefixes"."""
    import hashlib

    from shardloader.format.index import Index

    path = os.path.join(folder, "index.json")
    with open(path) as f:
        document = json.load(f)
    width = len(f"{prefixes - 1:x}")
    for entry in document["shards"]:
        digest = int.from_bytes(hashlib.sha256(entry["path"].encode()).digest()[:8], "big")
        prefix = f"{digest % prefixes:0{width}x}"
        os.makedirs(os.path.join(folder, prefix), exist_ok=True)
        for item in (entry, *(v for v in entry.values() if isinstance(v, dict) and "path" in v)):
            os.rename(os.path.join(folder, item["path"]), os.path.join(folder, prefix, item["path"]))
            item["path"] = f"{prefix}/{item['path']}"
    index = Index.from_json(document, source=path)  # checked as any reader checks it
    with open(path, "w") as f:
        f.write(index.dumps())
    return index


def _rank(node: int, rank: int, world: int, url: str, proxy: str, cache: str, out: str,
          start: Any, retry_mode: str | None) -> None:
    """Read one epoch as `rank` of `world`; write what was read and when."""
    import torch

    from shardloader import Dataset, Loader
    from shardloader.transforms import Compose, DecodeCropFlip, ToTensor

    torch.set_num_threads(1)
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": proxy, "region_name": "us-east-1"},
               "config_kwargs": {"user_agent_extra": f"node/{node}"}}
    if retry_mode is not None:  # botocore's retries stay off (one attempt); its mode's rate limiter may not
        options["config_kwargs"]["retries"] = {"mode": retry_mode, "total_max_attempts": 1}
    start.wait()
    began, cpu = time.monotonic(), time.process_time()
    dataset = Dataset(url, cache_dir=cache, cache_limit="256MB", storage_options=options)
    loader = Loader(dataset, batch_size=BATCH, shuffle=True, seed=0, num_workers=0,
                    transform=Compose([DecodeCropFlip(12), ToTensor()]),
                    rank=rank, world_size=world, partitions=PARTITIONS)
    first = first_cpu = None
    indices: list[int] = []
    for batch in loader:
        if first is None:
            first, first_cpu = time.monotonic(), time.process_time() - cpu
        indices.extend(batch["__index__"].tolist())
    loader.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"node": node, "rank": rank, "began": began, "first": first, "first_cpu": first_cpu,
                   "ended": time.monotonic(),
                   "indices": indices}, f)


def _node(node: int, ranks: int, world: int, url: str, proxy: str, root: str, start: Any,
          retry_mode: str | None) -> None:
    """One node: a process group of its own, its cache, `ranks` ranks (this process is the first)."""
    os.setpgid(0, 0)
    cache = os.path.join(root, f"cache-node{node}")
    out = os.path.join(root, "ranks")
    children = []
    for local in range(1, ranks):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank(node, node * ranks + local, world, url, proxy, cache, out, start, retry_mode)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        children.append(pid)
    _rank(node, node * ranks, world, url, proxy, cache, out, start, retry_mode)
    failed = [pid for pid in children if os.waitpid(pid, 0)[1] != 0]
    if failed:
        raise SystemExit(f"node {node}: {len(failed)} ranks failed")


def run(nodes: int, ranks: int, folder: str, index: Any, rate: float, burst: float,
        retry_mode: str | None = None) -> dict[str, Any]:
    """One measurement: `nodes` nodes of `ranks` ranks each against a fresh server."""
    root = tempfile.mkdtemp(prefix=f"many-nodes-{nodes}-")
    os.makedirs(os.path.join(root, "ranks"))
    world = nodes * ranks
    context = mp.get_context("fork")
    start = context.Event()
    try:
        with SlowDownServer({"ds": folder}, rate=rate, burst=burst) as server:
            procs = [context.Process(target=_node, args=(n, ranks, world, server.url("ds"), server.proxy,
                                                         root, start, retry_mode)) for n in range(nodes)]
            for p in procs:
                p.start()
            time.sleep(1.0)  # let the forks settle before the common start (not a synchronisation)
            started = time.monotonic()
            start.set()
            for p in procs:
                p.join(600)
            failed = [p.exitcode for p in procs if p.exitcode != 0]
            wall = time.monotonic() - started
            requests = server.stop()
        if failed:
            raise RuntimeError(f"{len(failed)} of {nodes} nodes failed: exit codes {failed[:5]}")
        reads = []
        for name in os.listdir(os.path.join(root, "ranks")):
            with open(os.path.join(root, "ranks", name)) as f:
                reads.append(json.load(f))
        return analyse(nodes, ranks, index, requests, reads, rate, started, wall)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def analyse(nodes: int, ranks: int, index: Any, requests: list[dict], reads: list[dict], rate: float,
            started: float, wall: float) -> dict[str, Any]:
    """The figures of one run (see the module docstring), and the checks that must hold."""
    shards = {f"/{BUCKET}/ds/{s.path}": s for s in index.shards}
    whole: Counter[tuple[str, str]] = Counter()  # (shard, node) -> successful whole GETs
    kinds: Counter[str] = Counter()
    by_node: Counter[str] = Counter()
    shard_bytes: Counter[str] = Counter()  # node -> body bytes of whole-shard GETs
    arrivals: dict[str, list[float]] = defaultdict(list)
    served: dict[str, list[float]] = defaultdict(list)  # those not answered 503
    for r in requests:
        path = r["path"].split("?", 1)[0]
        arrivals[prefix_of(r["path"])].append(r["started"])
        if not r["fault"]:
            served[prefix_of(r["path"])].append(r["started"])
        by_node[r["node"]] += r["sent"]
        info = shards.get(path)
        if r["fault"]:
            kinds["503"] += 1
        elif path.endswith("/index.json"):
            kinds["index.json"] += 1
        elif info is None:
            kinds["sidecars"] += 1
        elif _covers(r["range"], info.bytes):
            whole[(path, r["node"])] += 1
            kinds["whole shard"] += 1
            shard_bytes[r["node"]] += r["sent"]
        else:
            kinds["range of a shard"] += 1
    read_by: dict[str, set[str]] = defaultdict(set)  # node -> shards its ranks read
    for rank in reads:
        for i in rank["indices"]:
            read_by[str(rank["node"])].add(f"/{BUCKET}/ds/{index.shards[index.locate(i)[0]].path}")
    samples = sorted(i for rank in reads for i in rank["indices"])
    problems = []
    if samples != list(range(index.num_samples)):
        problems.append("the ranks together did not read every sample once")
    repeated = {key: n for key, n in whole.items() if n > 1}
    if repeated:
        problems.append(f"{len(repeated)} (shard, node) pairs downloaded more than once, e.g. "
                        f"{next(iter(repeated.items()))}")
    unread = [(path, node) for (path, node) in whole if path not in read_by[node]]
    if unread:
        problems.append(f"{len(unread)} shards downloaded by a node that read none of their rows")
    per_object = Counter(path for path, _ in whole)
    firsts = [rank["first"] - started for rank in reads]
    node_bytes = [by_node[str(n)] for n in range(nodes)]
    share = sum(s.bytes for s in index.shards) * ranks / (nodes * ranks)
    return {
        "nodes": nodes, "ranks per node": ranks, "requests": len(requests), **kinds,
        "whole GETs per shard (mean)": statistics.mean(per_object.values()) if per_object else 0,
        "whole GETs per shard (max)": max(per_object.values(), default=0),
        "whole GETs per (shard, node) (max)": max(whole.values(), default=0),
        "nodes reading a shard (mean)": statistics.mean(
            sum(p in read for read in read_by.values()) for p in shards),
        "peak req/s per prefix": max(_peak(times) for times in arrivals.values()),
        "peak served req/s per prefix": max(_peak(times) for times in served.values()),
        "peak req/s in all": _peak([r["started"] for r in requests]),
        "prefixes": len(arrivals),
        "limit req/s": rate,
        "bytes per node (mean)": statistics.mean(node_bytes),
        "bytes per node (max)": max(node_bytes),
        "whole-shard bytes per node (mean)": statistics.mean(shard_bytes[str(n)] for n in range(nodes)),
        "node share of shard bytes": share,
        "first batch s (median)": statistics.median(firsts),
        "first batch s (max)": max(firsts),
        "first batch CPU s (median)": statistics.median(rank["first_cpu"] for rank in reads),
        "wall s": wall,
        "problems": problems,
    }


def _covers(spec: str | None, size: int) -> bool:
    """Whether a GET with Range header `spec` (None: no range) asks for the whole object."""
    if spec is None:
        return True
    lo, _, hi = spec.removeprefix("bytes=").partition("-")
    return lo == "0" and (hi == "" or int(hi) >= size - 1)


def _peak(times: list[float], window: float = 1.0) -> int:
    """The most of `times` within any `window` seconds."""
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


COLUMNS = [
    ("N", "nodes"), ("ranks", "ranks per node"), ("requests", "requests"), ("503s", "503"),
    ("whole GETs/shard", "whole GETs per shard (mean)"),
    ("max per (shard,node)", "whole GETs per (shard, node) (max)"),
    ("nodes reading a shard", "nodes reading a shard (mean)"),
    ("range GETs", "range of a shard"), ("index GETs", "index.json"),
    ("sidecar GETs", "sidecars"),
    ("prefixes", "prefixes"), ("peak req/s/prefix", "peak req/s per prefix"),
    ("peak served/prefix", "peak served req/s per prefix"), ("peak req/s", "peak req/s in all"), ("limit/prefix", "limit req/s"),
    ("KB/node mean", "bytes per node (mean)"), ("KB/node max", "bytes per node (max)"),
    ("KB whole shards/node", "whole-shard bytes per node (mean)"), ("KB share", "node share of shard bytes"),
    ("first batch s med", "first batch s (median)"), ("first batch s max", "first batch s (max)"),
    ("first batch CPU s", "first batch CPU s (median)"),
    ("wall s", "wall s"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,4,16,64")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per node (1 from 32 nodes up)")
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s per prefix")
    parser.add_argument("--burst", type=float, default=50.0, help="requests a prefix may save up")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--shard-samples", type=int, default=16)
    parser.add_argument("--prefixes", type=int, default=1, help="spread the shards over this many hashed prefixes")
    parser.add_argument("--retry-mode", default=None, choices=["standard", "adaptive"],
                        help="botocore's retry mode in the storage options (attempts stay 1)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: F401 - imported once here, before the forks

    import shardloader.loader  # noqa: F401
    folder = tempfile.mkdtemp(prefix="many-nodes-data-")
    try:
        index = make_dataset(folder, args.samples, args.shard_samples, args.prefixes)
        print(f"machine: {machine()}; {load_average()}")
        print(f"data: {index.num_samples} samples in {index.num_shards} shards of "
              f"{statistics.mean(s.bytes for s in index.shards) / 1e3:.1f} KB under {args.prefixes} prefixes; "
              f"limit {args.rate:g} req/s per prefix, burst {args.burst:g}; {PARTITIONS} partitions, "
              f"batch {BATCH} per rank, num_workers=0", flush=True)
        results = []
        for n in (int(x) for x in args.nodes.split(",")):
            ranks = args.ranks if n < 32 else 1
            result = run(n, ranks, folder, index, args.rate, args.burst, args.retry_mode)
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
        rows = [[_cell(r.get(key, 0), key) for _, key in COLUMNS] for r in results]
        print(table([name for name, _ in COLUMNS], rows))
        for r in results:
            for problem in r["problems"]:
                print(f"N={r['nodes']}: {problem}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _cell(value: Any, key: str) -> Any:
    if "bytes" in key:
        return value / 1e3
    return value if value is not None else "-"


if __name__ == "__main__":
    main()
